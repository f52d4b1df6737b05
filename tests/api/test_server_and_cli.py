"""A real uvicorn server (`greenflow serve`) driven by the real CLI, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from scheduler_service.db import migrate
from tests.api.conftest import make_tokens
from tests.support.processes import free_port, run_cli, running


def test_serve_and_client_commands(database_url: str, tmp_path: Path) -> None:
    port = free_port()
    env = {
        "GREENFLOW_DATABASE_URL": database_url,
        "GREENFLOW_PORT": str(port),
        "GREENFLOW_RUN_CONTROL_LOOP": "false",
    }
    operator = run_cli(["token", "create", "--role", "operator", "--name", "root"], env)
    assert operator.returncode == 0, operator.stderr
    token = operator.stdout.strip()
    assert token.startswith("gf_")
    alice = make_tokens(database_url).alice

    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: yaml-job\nworkload: bert\nglobal_batch_size: 32\ntotal_steps: 100\n"
        "min_gpus: 1\nmax_gpus: 4\nsubmission_id: nightly-1\n"
    )
    bad_spec = tmp_path / "bad.json"
    bad_spec.write_text(
        json.dumps(
            {
                "name": "x",
                "workload": "gpt2",
                "global_batch_size": 8,
                "total_steps": 5,
                "min_gpus": 4,
                "max_gpus": 2,
            }
        )
    )
    url = f"http://127.0.0.1:{port}"
    with running(["serve"], env, tmp_path / "serve.log", health_url=f"{url}/healthz"):
        client_env = {"GREENFLOW_URL": url, "GREENFLOW_TOKEN": alice}
        submitted = run_cli(["submit", str(spec)], client_env)
        assert submitted.returncode == 0, submitted.stderr
        assert "job 1 QUEUED" in submitted.stdout
        # Same submission_id: the existing job comes back, nothing is duplicated.
        assert "job 1 " in run_cli(["submit", str(spec)], client_env).stdout

        rejected = run_cli(["submit", str(bad_spec)], client_env)
        assert rejected.returncode == 2
        assert "min_gpus" in rejected.stderr
        assert "Traceback" not in rejected.stderr

        listing = run_cli(["jobs"], client_env)
        assert listing.returncode == 0
        assert "yaml-job" in listing.stdout
        assert "1 of 1 jobs" in listing.stdout

        shown = run_cli(["job", "1"], client_env)
        assert "PENDING → QUEUED" in shown.stdout

        # The operator sees alice's job; an unknown job is a one-line error, exit 1.
        assert (
            "yaml-job" in run_cli(["jobs"], {"GREENFLOW_URL": url, "GREENFLOW_TOKEN": token}).stdout
        )
        missing = run_cli(["job", "99"], client_env)
        assert missing.returncode == 1
        assert "not found" in missing.stderr

        cancelled = run_cli(["cancel", "1", "--reason", "no longer needed"], client_env)
        assert cancelled.returncode == 0
        assert "CANCELLED" in cancelled.stdout
        events = httpx.get(
            f"{url}/v1/jobs/1/events", headers={"Authorization": f"Bearer {alice}"}
        ).json()
        assert events[-1]["reason"] == "no longer needed"

        no_token = run_cli(["jobs"], {"GREENFLOW_URL": url, "GREENFLOW_TOKEN": ""})
        assert no_token.returncode == 2
        assert "GREENFLOW_TOKEN" in no_token.stderr


def test_invalid_config_stops_start_up_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "greenflow.toml"
    config.write_text('[budget]\nperiod = "fortnight"\nlimit_kg_co2e = 10\n')
    env = {
        "GREENFLOW_CONFIG": str(config),
        "GREENFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
    }
    result = run_cli(["serve"], env)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "budget.period" in lines[0]
    assert "fortnight" in lines[0]
    assert "'day', 'week' or 'month'" in lines[0]

    config.write_text("[cluster]\npue = 0.5\n")
    result = run_cli(["db", "upgrade"], env)
    assert result.returncode == 2
    assert "cluster.pue" in result.stderr

    config.write_text("this is = not toml [")
    result = run_cli(["serve"], env)
    assert result.returncode == 2
    assert "not valid TOML" in result.stderr


def test_usage_errors_are_one_plain_line_naming_the_option(tmp_path: Path) -> None:
    env = {"GREENFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}"}
    simulate = ["simulate", "--jobs", "t.csv", "--carbon", "c.csv", "--out", "r.json"]
    cases = [
        ([*simulate, "--policy", "static", "--cluster", "4"], "--cluster"),
        ([*simulate, "--cluster", "2x8"], "--policy"),  # missing option
        ([*simulate, "--cluster", "2x8", "--policy", "static", "--slot-s", "abc"], "--slot-s"),
        ([*simulate, "--colour", "red"], "--colour"),
        (["frobnicate"], "frobnicate"),
    ]
    for args, named in cases:
        result = run_cli(args, env)
        assert result.returncode == 2, (args, result.stderr)
        # One line a script can grep, not typer's wrapped box.
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("error: ") and named in lines[0], lines[0]
        assert "╭" not in result.stderr and "Traceback" not in result.stderr


def test_serve_refuses_an_unmigrated_database(tmp_path: Path) -> None:
    env = {"GREENFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'empty.db'}"}
    result = run_cli(["serve"], env)
    assert result.returncode == 2
    assert "greenflow db upgrade" in result.stderr


def test_the_example_config_is_valid() -> None:
    from scheduler_service.settings import load_config

    example = Path(__file__).resolve().parents[2] / "greenflow.toml"
    config = load_config(example)
    assert config.budget.enforcement in {"hard", "soft"}


def test_planner_policy_names_the_registered_policies(tmp_path: Path) -> None:
    from typing import get_args

    from scheduler_service.allocation.policies import POLICIES
    from scheduler_service.settings import ConfigError, PolicyName, load_config

    assert set(get_args(PolicyName)) == set(POLICIES)
    config = tmp_path / "greenflow.toml"
    config.write_text('[planner]\npolicy = "carbon-agnostic"\n')
    assert load_config(config).planner.policy == "carbon-agnostic"
    config.write_text('[planner]\npolicy = "fastest"\n')
    with pytest.raises(ConfigError, match=r"planner\.policy"):
        load_config(config)


def test_token_and_node_credential_commands(tmp_path: Path) -> None:
    # The rules themselves are tested in-process on both backends (test_node_identity.py);
    # this checks the commands, on SQLite (each CLI call is a process start).
    database_url = f"sqlite:///{tmp_path / 'cli.db'}"
    migrate.upgrade(database_url)
    env = {"GREENFLOW_DATABASE_URL": database_url}
    first = run_cli(["token", "create", "--role", "user", "--name", "carol"], env)
    assert first.returncode == 0, first.stderr
    # One active token per role and name: a second "carol" would be a second identity.
    again = run_cli(["token", "create", "--role", "user", "--name", "carol"], env)
    assert again.returncode == 2
    assert "active user token named 'carol' exists" in again.stderr
    replaced = run_cli(
        [
            "token",
            "create",
            "--role",
            "user",
            "--name",
            "carol",
            "--replace",
            "--expires-in-days",
            "1",
        ],
        env,
    )
    assert replaced.returncode == 0, replaced.stderr
    new_id = replaced.stdout.strip().split("_")[1]
    assert run_cli(["token", "revoke", new_id], env).returncode == 0
    listing = run_cli(["token", "list", "--all"], env)
    assert listing.returncode == 0, listing.stderr
    rows = [line for line in listing.stdout.splitlines() if "carol" in line]
    assert len(rows) == 2 and new_id in "".join(rows)
    node = run_cli(["node", "enrol", "node-7"], env)
    assert node.returncode == 0 and node.stdout.startswith("gf_")
    gone = run_cli(["node", "revoke", "node-7"], env)
    assert gone.returncode == 0, gone.stderr
