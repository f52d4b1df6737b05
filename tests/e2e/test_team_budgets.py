"""Team budgets end to end (issue 22): `greenflow serve` and one agent with two simulated slots;
team "nlp" (queue "nlp") has a hard budget that pays for a few seconds of its job, team "vision" a
roomy one. The plan runs nlp's job only as far as its budget goes (and the budget watchdog pauses
it if its measured spend gets there first); then it is paused and stays paused, while vision's
job runs to the end."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from scheduler_service.db import migrate
from tests.api.conftest import make_tokens
from tests.support.processes import GREENFLOW, free_port, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = """
[budget]
limit_kg_co2e = 1000.0
[budget.teams.nlp]
queues = ["nlp"]
# About four 5 s slots of the mlp job on one simulated GPU (0.2 g each as planned).
limit_kg_co2e = 0.001
[budget.teams.vision]
queues = ["vision"]
limit_kg_co2e = 1000.0

[planner]
slot_s = 5
horizon_s = 120
solver_time_limit_s = 2.0

[cluster]
agent_heartbeat_interval_s = 0.5
agent_telemetry_interval_s = 0.5
"""


def _job(name: str, queue: str, steps: int) -> dict[str, object]:
    return {
        "name": name,
        "workload": "mlp",
        "queue": queue,
        "global_batch_size": 16,
        "total_steps": steps,
        "min_gpus": 1,
        "max_gpus": 1,
    }


def test_a_spent_team_budget_stops_only_that_teams_job(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "greenflow.toml"
    config.write_text(CONFIG)
    database_url = f"sqlite:///{tmp_path / 'greenflow.db'}"
    env = {
        "GREENFLOW_DATABASE_URL": database_url,
        "GREENFLOW_CONFIG": str(config),
        "GREENFLOW_PORT": str(port),
    }
    migrate.upgrade(database_url, "head")
    tokens = make_tokens(database_url)
    user = {"Authorization": f"Bearer {tokens.alice}"}
    operator = {"Authorization": f"Bearer {tokens.operator}"}
    url = f"http://127.0.0.1:{port}"

    with running(["serve"], env, tmp_path / "serve.log", health_url=f"{url}/healthz"):
        log = (tmp_path / "agent.log").open("wb")
        agent = subprocess.Popen(
            [
                GREENFLOW,
                "agent",
                "--scheduler",
                url,
                "--token",
                tokens.agent,
                "--simulate-gpus",
                "2",
                "--name",
                "node-1",
                "--no-checkpoints",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            nlp = httpx.post(f"{url}/v1/jobs", json=_job("nlp", "nlp", 100_000), headers=user)
            vision = httpx.post(f"{url}/v1/jobs", json=_job("vision", "vision", 300), headers=user)
            assert nlp.status_code == 201 and vision.status_code == 201, (nlp.text, vision.text)
            nlp_id, vision_id = nlp.json()["id"], vision.json()["id"]

            def state(job_id: int) -> str:
                return str(httpx.get(f"{url}/v1/jobs/{job_id}", headers=user).json()["state"])

            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and state(vision_id) != "SUCCEEDED":
                assert state(vision_id) not in ("FAILED", "CANCELLED")
                time.sleep(0.5)
            assert state(vision_id) == "SUCCEEDED", (tmp_path / "serve.log").read_text()[-3000:]
            # nlp's job ran while its team's budget paid for it, then was paused (by the plan,
            # which keeps the team's budget, or by the watchdog if the spend got there first).
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and state(nlp_id) != "DEFERRED":
                time.sleep(0.5)
            assert state(nlp_id) == "DEFERRED"
            events = httpx.get(f"{url}/v1/jobs/{nlp_id}/events", headers=user).json()
            assert any("team 'nlp'" in e["reason"] for e in events), events
            assert any(e["to_state"] == "RUNNING" for e in events)  # it did run first
            budget = httpx.get(f"{url}/v1/budget", headers=operator).json()
            teams = {t["name"]: t["current"] for t in budget["teams"]}
            # Spent, or too little left for another slot of its job (0.2-0.4 g as planned at
            # the synthetic grid's 250-550 g/kWh and the upper quantile).
            assert teams["nlp"]["left_kg_co2e"] < 0.0005, teams["nlp"]
            assert teams["vision"]["spent_kg_co2e"] > 0
            # The cluster's budget is far from spent: only the team's stopped the job.
            assert budget["periods"][0]["left_kg_co2e"] > 900
            time.sleep(3)
            assert state(nlp_id) == "DEFERRED"
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=60)
            finally:
                if agent.poll() is None:
                    agent.kill()
                    agent.wait()
