"""The README's "Bring your own model" walk-through, end to end with real processes.

`greenflow serve` (SQLite) and one agent with two simulated GPU slots; each example is submitted
with `greenflow submit --workdir examples/<name>` (the CLI packs and uploads the directory; the
agent fetches it by hash and imports the job module from it). The operator narrows the GPUs it
may use to one (`POST /v1/jobs/{id}/gpus`: hot switch 1, 2 -> 1), then to exactly two (hot
switch 2, 1 -> 2): both switches are forced by the range, not left to the planner's choice. It
finishes, its output is read back with `greenflow logs`, and the exported directory is loaded in
a fresh interpreter with plain transformers (no GreenFlow on the path).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from scheduler_service.db import migrate
from tests.api.conftest import make_tokens
from tests.e2e.test_end_to_end import write_hourly_trace
from tests.support.processes import GREENFLOW, free_port, run_cli, wait_http_ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

CONFIG = """\
[budget]
period = "day"
limit_kg_co2e = 1000
[carbon]
provider = "trace"
region = "examples"
trace_path = "{trace}"
clock_speedup = 720
forecast_mode = "oracle"
[planner]
slot_s = 5
horizon_s = 100
solver_time_limit_s = 2.0
[cluster]
# Generous: a node declared lost under a loaded machine re-queues the job mid-test.
heartbeat_timeout_s = 60
agent_heartbeat_interval_s = 1
agent_telemetry_interval_s = 1
[workloads]
allowed_entrypoints = {entrypoints}
"""
EXAMPLE_ENTRYPOINTS = ("lm_job", "resnet_job")


class Stack:
    """`greenflow serve` and one agent, with a user token for the CLI."""

    def __init__(self, tmp: Path, entrypoints: tuple[str, ...] = EXAMPLE_ENTRYPOINTS) -> None:
        self.tmp = tmp
        url = f"sqlite:///{tmp / 'greenflow.db'}"
        migrate.upgrade(url)
        tokens = make_tokens(url)
        trace = tmp / "trace.csv"
        write_hourly_trace(trace, lambda hour: 50.0)
        config = tmp / "greenflow.toml"
        config.write_text(CONFIG.format(trace=trace, entrypoints=json.dumps(list(entrypoints))))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.env = {
            **os.environ,
            "GREENFLOW_DATABASE_URL": url,
            "GREENFLOW_CONFIG": str(config),
            "GREENFLOW_PORT": str(port),
            "GREENFLOW_SECRET_KEY": secrets.token_urlsafe(48),
        }
        self.cli_env = {"GREENFLOW_URL": self.url, "GREENFLOW_TOKEN": tokens.alice}
        self.tokens = tokens
        self.agent_token = tokens.agent
        self.processes: list[subprocess.Popen[bytes]] = []
        # The operator sees nodes and every job.
        self.api = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {tokens.operator}"}, timeout=30
        )

    def spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = (self.tmp / log_name).open("ab")
        process = subprocess.Popen(
            [GREENFLOW, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        self.processes.append(process)
        return process

    def get(self, path: str) -> Any:
        response = self.api.get(path)
        response.raise_for_status()
        return response.json()

    def events(self, job_id: int) -> list[dict[str, Any]]:
        return list(self.get(f"/v1/jobs/{job_id}/events"))

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.api.close()

    def wait_until(self, what: str, condition: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(1)
        lines = []
        for job in self.get("/v1/jobs")["items"]:
            lines.append(f"job {job['id']} {job['state']} {job['samples_done']}")
            lines += [
                f"    {e['at'][11:19]} {e['kind']} {e['to_state']} {e['reason']}"
                for e in self.events(job["id"])
            ]
        logs = "\n".join(
            f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(self.tmp.glob("*.log"))
        )
        raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(lines) + "\n" + logs)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def _plain_python(example: Path, code: str) -> Any:
    """Run `code` in a fresh interpreter with only the example on the path; its last line, JSON."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=example,
        env={**env, "PYTHONPATH": str(example)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def _broken_job_fails_and_the_agent_carries_on(stack: Stack, tmp_path: Path) -> None:
    """A job module whose function returns the wrong thing: the job fails with that reason in
    its events; the agent stays up and its slots are free again for the next job."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "lm_job.py").write_text("def job(**options):\n    return 42\n")
    spec = {"name": "broken", "workload": "lm_job:job", "global_batch_size": 8, "total_steps": 5}
    (broken / "job.yaml").write_text(yaml.safe_dump(spec))
    submitted = run_cli(
        ["submit", str(broken / "job.yaml"), "--workdir", str(broken)],
        env=stack.cli_env,
        timeout_s=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(stack.get("/v1/jobs")["items"][0]["id"])
    stack.wait_until(
        "the broken job failed", lambda: stack.get(f"/v1/jobs/{job_id}")["state"] == "FAILED", 240
    )
    reason = stack.get(f"/v1/jobs/{job_id}")["state_reason"]
    assert "the job's code failed on node node-1" in reason, reason
    assert "lm_job:job returned int" in reason, reason
    assert stack.processes[1].poll() is None  # the agent
    node = stack.get("/v1/nodes")[0]
    stack.wait_until(
        "its slots freed",
        lambda: all(s["job_id"] is None for s in stack.get("/v1/nodes")[0]["slots"]),
        60,
    )
    assert node["state"] == "ready"


def start_stack(stack: Stack, tmp_path: Path) -> None:
    """`greenflow serve`, then an agent with two simulated slots registered as node-1."""
    stack.spawn(["serve"], "scheduler.log")
    wait_http_ok(f"{stack.url}/healthz", timeout_s=180, process=stack.processes[0])
    stack.spawn(
        [
            "agent",
            "--scheduler",
            stack.url,
            "--token",
            stack.agent_token,
            "--simulate-gpus",
            "2",
            "--name",
            "node-1",
            "--no-checkpoints",
            "--data-dir",
            str(tmp_path / "agent"),
            "--export-dir",
            str(tmp_path / "exports"),
        ],
        "agent.log",
    )
    stack.wait_until("the node", lambda: len(stack.get("/v1/nodes")) == 1, 120)


def _run_example(
    stack: Stack,
    tmp_path: Path,
    example: Path,
    steps: int,
    follow: bool,
    before: Callable[[Stack, Path], None] | None = None,
) -> tuple[int, Path, str]:
    """Start the stack, submit `example` with --workdir, make it switch twice, wait for its end;
    return its id, its export directory and what `submit --follow` printed (if it followed)."""
    start_stack(stack, tmp_path)
    if before is not None:
        before(stack, tmp_path)
    known = {job["id"] for job in stack.get("/v1/jobs")["items"]}

    # The example's own job.yaml, shorter than the example trains.
    spec = yaml.safe_load((example / "job.yaml").read_text())
    spec["total_steps"] = steps
    spec["options"]["total_steps"] = steps
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(spec))
    args = [GREENFLOW, "submit", str(job_file), "--workdir", str(example)]
    env = {**os.environ, **stack.cli_env, "COLUMNS": "200"}
    submit = subprocess.Popen(
        [*args, "--follow"] if follow else args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def new_jobs() -> list[int]:
        return [job["id"] for job in stack.get("/v1/jobs")["items"] if job["id"] not in known]

    stack.wait_until("the job submitted", lambda: bool(new_jobs()), 120)
    job_id = int(new_jobs()[0])
    job = stack.get(f"/v1/jobs/{job_id}")
    assert job["workload"] == spec["workload"] and len(job["bundle"]) == 64

    def gpus() -> int:
        return int(stack.get(f"/v1/jobs/{job_id}")["current_gpus"])

    def switches() -> int:
        return sum(e["kind"] == "hot_switch" for e in stack.events(job_id))

    stack.wait_until("the example on both slots", lambda: gpus() == 2, 240)

    # The operator narrows the GPUs it may use to one, then to exactly two: the next plans
    # must hot-switch it down and back up (not the planner's choice, the range's).
    def allow(low: int, high: int) -> None:
        response = stack.api.post(
            f"/v1/jobs/{job_id}/gpus", json={"min_gpus": low, "max_gpus": high}
        )
        assert response.status_code == 200, response.text

    allow(1, 1)
    stack.wait_until("a hot switch down", lambda: switches() >= 1 and gpus() == 1, 180)
    step_down = stack.get(f"/v1/jobs/{job_id}")["step"]
    allow(2, 2)
    stack.wait_until("a hot switch back up", lambda: switches() >= 2 and gpus() == 2, 180)
    moves = [
        (e["details"]["from_gpus"], e["details"]["to_gpus"], e["details"]["step"])
        for e in stack.events(job_id)
        if e["kind"] == "hot_switch"
    ]
    assert [(a, b) for a, b, _ in moves[:2]] == [(2, 1), (1, 2)], moves
    assert moves[0][2] <= step_down <= moves[1][2], moves
    stack.wait_until(
        "the example finished",
        lambda: stack.get(f"/v1/jobs/{job_id}")["state"] in ("SUCCEEDED", "FAILED"),
        400,
    )
    printed, errors = submit.communicate(timeout=60)
    assert submit.returncode == 0, errors
    assert "bundle" in printed
    job = stack.get(f"/v1/jobs/{job_id}")
    assert job["state"] == "SUCCEEDED", job["state_reason"]
    assert job["samples_done"] == steps * spec["global_batch_size"]
    export = tmp_path / "exports" / f"job-{job_id}"
    stack.wait_until("the export", lambda: (export / "greenflow.json").is_file(), 60)
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    return job_id, export, printed


def test_language_model_example(stack: Stack, tmp_path: Path) -> None:
    example = EXAMPLES / "hf_causal_lm"
    job_id, export, _ = _run_example(
        stack,
        tmp_path,
        example,
        steps=240,
        follow=False,
        before=_broken_job_fails_and_the_agent_carries_on,
    )

    # The job's output, kept by the agent, through the scheduler: what its module printed and
    # the numbers it logged with greenflow_log (from the worker that is rank 0 at the end).
    printed = run_cli(["logs", str(job_id)], env=stack.cli_env, timeout_s=60)
    assert printed.returncode == 0, printed.stderr
    assert "corpus: " in printed.stdout and "windows of 32" in printed.stdout
    # The other rank's worker printed the same; --follow on an ended job prints all and stops.
    other = run_cli(["logs", str(job_id), "--rank", "1"], env=stack.cli_env, timeout_s=60)
    assert other.returncode == 0 and "corpus: " in other.stdout, other.stderr
    followed = run_cli(["logs", str(job_id), "--follow"], env=stack.cli_env, timeout_s=60)
    assert followed.returncode == 0 and followed.stdout == printed.stdout
    logged = run_cli(["logs", str(job_id), "--scalars"], env=stack.cli_env, timeout_s=60)
    assert logged.returncode == 0, logged.stderr
    lines = [json.loads(line) for line in logged.stdout.splitlines() if line.strip()]
    assert lines and all(set(line["scalars"]) == {"loss", "tokens"} for line in lines)
    assert lines[-1]["step"] > lines[0]["step"] and lines[-1]["rank"] == 0

    loss, params = _plain_python(
        example,
        "import json, torch\n"
        "from transformers import LlamaForCausalLM\n"
        "from lm_job import TextWindows, make_corpus\n"
        f"model = LlamaForCausalLM.from_pretrained({str(export)!r})\n"
        "model.eval()\n"
        "data = TextWindows(make_corpus(200, seed=7), 32)\n"
        "batch = torch.utils.data.default_collate([data[i] for i in range(32)])\n"
        "with torch.no_grad():\n"
        "    loss = model(**batch).loss.item()\n"
        "print(json.dumps([loss, sum(p.numel() for p in model.parameters())]))\n",
    )
    # A random model scores about ln(28) (the characters); the trained one well below.
    assert math.isfinite(loss) and loss < 0.7 * math.log(28), loss
    assert params > 100_000


def test_resnet_example_followed_from_submit(stack: Stack, tmp_path: Path) -> None:
    example = EXAMPLES / "resnet_images"
    _, export, followed = _run_example(stack, tmp_path, example, steps=400, follow=True)
    # `submit --follow` printed the state changes and the hot switch as they happened.
    assert "QUEUED -> RUNNING" in followed and "SUCCEEDED" in followed
    assert followed.count("hot_switch") >= 2, followed
    accuracy = _plain_python(
        example,
        "import json\n"
        "from classify import accuracy, load\n"
        f"print(json.dumps(accuracy(load({str(export)!r}))))\n",
    )
    # Four classes: chance is 0.25.
    assert accuracy > 0.5, accuracy
