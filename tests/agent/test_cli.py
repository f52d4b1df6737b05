"""`greenflow agent` input errors and a refused registration: one line on stderr, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.fake_scheduler import fake_scheduler
from tests.support.processes import GREENFLOW

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]


def _agent(*args: str, real_command: bool = False) -> subprocess.CompletedProcess[str]:
    # `python -m worker_agent.cli` runs the same function without importing the whole scheduler.
    command = [GREENFLOW, "agent"] if real_command else [sys.executable, "-m", "worker_agent.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_bad_input_is_one_line_exit_2() -> None:
    base = ["--scheduler", "http://127.0.0.1:1", "--token", "t"]
    assert "exactly one of" in _one_error_line(_agent(*base))
    assert "exactly one of" in _one_error_line(_agent(*base, "--gpus", "1", "--simulate-gpus", "1"))
    assert "between 1 and 1024" in _one_error_line(_agent(*base, "--simulate-gpus", "0"))
    assert "--name" in _one_error_line(_agent(*base, "--simulate-gpus", "1", "--name", "a b"))
    line = _one_error_line(_agent("--scheduler", "ftp://x", "--token", "t", "--simulate-gpus", "1"))
    assert "--scheduler" in line
    both = _agent(*base, "--simulate-gpus", "1", "--checkpoint-dir", "/tmp", "--no-checkpoints")
    assert "--no-checkpoints" in _one_error_line(both)
    # Parse errors too: one plain line (no usage banner or box), naming the option.
    unknown = _agent(*base, "--scheduler-url", "x")
    assert "--scheduler-url" in _one_error_line(unknown)
    assert len([x for x in unknown.stderr.splitlines() if x.strip()]) == 1, unknown.stderr


def test_gpus_refused_without_enough_cuda_devices() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    line = _one_error_line(
        _agent("--scheduler", "http://127.0.0.1:1", "--token", "t", "--gpus", "1")
    )
    assert "only 0 CUDA device(s)" in line


def test_rejected_token_stops_the_agent_with_exit_2() -> None:
    with fake_scheduler(token="right") as fake:
        args = ["--scheduler", fake.url, "--token", "wrong", "--simulate-gpus", "1", "--name", "n"]
        result = _agent(*args, real_command=True)
        assert fake.unauthorized >= 1
    assert "HTTP 401" in _one_error_line(result)


def test_the_token_comes_once_and_from_a_file_if_wanted(tmp_path: Path) -> None:
    # Review: the agent token was given in argv, visible to every user in `ps`.
    base = ["--scheduler", "http://127.0.0.1:1", "--simulate-gpus", "1"]
    assert "credential" in _one_error_line(_agent(*base))
    token_file = tmp_path / "token"
    token_file.write_text("gf_abc_" + "x" * 40 + "\n")
    both = _agent(*base, "--token", "t", "--token-file", str(token_file))
    assert "once" in _one_error_line(both)
    missing = _agent(*base, "--token-file", str(tmp_path / "none"))
    assert "cannot read" in _one_error_line(missing)


def test_rendezvous_address_rules() -> None:
    from worker_agent.cli import rendezvous_address

    scheduler = "http://127.0.0.1:8080"
    assert rendezvous_address("none", "198.18.0.2", scheduler) is None
    assert rendezvous_address("198.18.0.9", "127.0.0.1", scheduler) == "198.18.0.9"
    # The API on one specific non-loopback address: that is the address others reach.
    assert rendezvous_address("auto", "198.18.0.2", scheduler) == "198.18.0.2"
    # Everything on loopback (a one-machine cluster): jobs stay inside their node.
    assert rendezvous_address("auto", "127.0.0.1", scheduler) is None
    assert rendezvous_address("auto", "0.0.0.0", "http://localhost:8080") is None
