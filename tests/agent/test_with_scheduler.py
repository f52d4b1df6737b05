"""`greenflow agent` against the real scheduler (`greenflow serve`, SQLite, control loop on): it
registers, heartbeats, receives the placement of a submitted job, trains it to the end and
reports telemetry that finishes the job.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from scheduler_service.db import migrate
from scheduler_service.db.models import NodePowerReading
from scheduler_service.db.session import make_engine
from tests.api.conftest import make_tokens
from tests.support.processes import GREENFLOW, free_port, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CONFIG = """
[planner]
slot_s = 5
horizon_s = 120
solver_time_limit_s = 2.0

[cluster]
agent_heartbeat_interval_s = 0.5
agent_telemetry_interval_s = 0.5
"""


def _node_power_sources(database_url: str) -> set[tuple[str, str]]:
    """(component, source) of the stored node power readings, once there are both kinds."""
    engine = make_engine(database_url)
    try:
        deadline = time.monotonic() + 20
        while True:
            with engine.connect() as conn:
                rows = conn.execute(select(NodePowerReading.component, NodePowerReading.source))
                found = {(str(c), str(s)) for c, s in rows}
            if len(found) >= 2 or time.monotonic() > deadline:
                return found
            time.sleep(0.5)
    finally:
        engine.dispose()


def test_agent_runs_a_job_the_real_scheduler_places(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "greenflow.toml"
    config.write_text(CONFIG)
    env = {
        "GREENFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'greenflow.db'}",
        "GREENFLOW_CONFIG": str(config),
        "GREENFLOW_PORT": str(port),
    }
    # Schema and tokens in-process (the CLI's own tests cover those commands); the scheduler and
    # the agent run as real processes.
    migrate.upgrade(env["GREENFLOW_DATABASE_URL"], "head")
    tokens = make_tokens(env["GREENFLOW_DATABASE_URL"])
    agent_token = tokens.agent
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
                agent_token,
                "--simulate-gpus",
                "2",
                "--name",
                "node-1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            nodes: list[dict[str, object]] = []
            while time.monotonic() < deadline and not nodes:
                nodes = httpx.get(f"{url}/v1/nodes", headers=operator).json()
                time.sleep(0.2)
            assert nodes, "agent never registered"
            node = nodes[0]
            assert node["name"] == "node-1" and node["simulated"] is True
            assert len(node["slots"]) == 2  # type: ignore[arg-type]
            assert str(node["agent_url"]).startswith("http://127.0.0.1:")

            job = {
                "name": "agent-e2e",
                "workload": "mlp",
                "global_batch_size": 16,
                "total_steps": 200,
                "min_gpus": 1,
                "max_gpus": 2,
            }
            created = httpx.post(f"{url}/v1/jobs", json=job, headers=user)
            assert created.status_code == 201, created.text
            job_id = created.json()["id"]
            state = ""
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline and state != "SUCCEEDED":
                state = httpx.get(f"{url}/v1/jobs/{job_id}", headers=user).json()["state"]
                assert state not in ("FAILED", "CANCELLED"), state
                time.sleep(0.5)
            assert state == "SUCCEEDED", (tmp_path / "agent.log").read_text()[-3000:]

            samples = httpx.get(f"{url}/v1/jobs/{job_id}/telemetry", headers=user).json()
            assert samples, "no telemetry stored"
            assert {s["power_source"] for s in samples} == {"estimated"}
            assert samples[-1]["samples_done"] == 200 * 16
            assert all(s["energy_kwh"] > 0 and s["gpus"] >= 1 for s in samples)
            heartbeat = httpx.get(f"{url}/v1/nodes", headers=operator).json()[0]
            assert heartbeat["heartbeat_age_s"] < 10
            # Every sample names the node that measured it.
            assert {s["node_id"] for s in samples} == {heartbeat["id"]}
            # The node reports its whole draw as well: the host and the GPUs no job holds,
            # labelled as the node model's estimates (no NVML, DCGM or RAPL here).
            assert _node_power_sources(env["GREENFLOW_DATABASE_URL"]) == {
                ("gpu", "estimated"),
                ("host", "estimated"),
            }
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                assert agent.wait(timeout=60) == 0
            finally:
                if agent.poll() is None:
                    agent.kill()
                log.close()
