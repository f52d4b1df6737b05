"""End to end with real processes: PostgreSQL, a uvicorn scheduler, two agents, a carbon trace.

The trace has a dirty window, then a clean one, on a compressed clock (one trace hour = 5 s).
We submit three jobs and check that GPU counts follow the intensity, that a job is hot-switched
in place (same worker PIDs, step never goes back), that every job completes within the budget,
and that killing the scheduler or an agent loses nothing.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from scheduler_service.auth.service import create_token
from scheduler_service.auth.tokens import Role
from scheduler_service.db import migrate
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from tests.api.conftest import fresh_postgres_database, make_tokens
from tests.support.processes import GREENFLOW, free_port, wait_http_ok

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(900)]

TRACE_HOUR_S = 5.0
# Far dirtier than any real grid, so that even a slot straddling the boundary is over budget.
DIRTY_G_PER_KWH = 5000.0
CLEAN_G_PER_KWH = 5.0


def write_hourly_trace(
    path: Path, intensity_at_hour: Callable[[int], float], hours: int = 120
) -> None:
    """An `hours`-hour `time,intensity` trace; the replay starts at hour `hours // 2` (the
    provider keeps the first half as the forecaster's history)."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rows = ["time,intensity"]
    for hour in range(hours):
        rows.append(f"{(start + timedelta(hours=hour)).isoformat()},{intensity_at_hour(hour)}")
    path.write_text("\n".join(rows) + "\n")


def _write_trace(path: Path) -> None:
    # From the replay's start: 6 hours dirty (30 s), then 150 clean (750 s), then dirty again.
    # The clean window outlasts the test's waits, so a slow machine never sees it end: the
    # jobs would sit paused for want of budget.
    hours = 320
    first_clean = hours // 2 + 6
    write_hourly_trace(
        path,
        lambda hour: (
            CLEAN_G_PER_KWH if first_clean <= hour < first_clean + 150 else DIRTY_G_PER_KWH
        ),
        hours,
    )


CONFIG = """\
[budget]
period = "day"
limit_kg_co2e = {budget_kg}
enforcement = "hard"
[carbon]
provider = "trace"
region = "e2e"
trace_path = "{trace}"
clock_speedup = {speedup}
forecast_mode = "oracle"
conservative_intensity_g_per_kwh = 5000
[planner]
slot_s = 5
horizon_s = 100
solver_time_limit_s = 2.0
[cluster]
pue = 1.2
heartbeat_timeout_s = 8
agent_heartbeat_interval_s = 1
agent_telemetry_interval_s = 1
# The hard budget here is sized for what the jobs draw: the nodes' idle-GPU and host draw until
# the day's end (charged, and reserved by the planner: tests/budget/test_node_power.py) would
# take all of it, so the node model is zero and the budget measures the planner and watchdog.
idle_power_per_gpu_w = 0
host_power_w = 0
"""

# Less than one second of one GPU costs in the dirty hours (about 0.6 g); the clean hours need a
# fraction of it. So nothing may run while it is dirty, not even in a slot straddling the change.
BUDGET_KG = 0.0004


class Stack:
    """The scheduler and agent processes of one test."""

    def __init__(self, tmp: Path, database_url: str) -> None:
        self.tmp = tmp
        trace = tmp / "trace.csv"
        _write_trace(trace)
        config = tmp / "greenflow.toml"
        config.write_text(
            CONFIG.format(budget_kg=BUDGET_KG, trace=trace, speedup=3600 / TRACE_HOUR_S)
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "GREENFLOW_DATABASE_URL": database_url,
            "GREENFLOW_CONFIG": str(config),
            "GREENFLOW_PORT": str(self.port),
            "GREENFLOW_SECRET_KEY": secrets.token_urlsafe(48),
            # The agents' default checkpoint directory (XDG data dir), shared by both agents.
            "XDG_DATA_HOME": str(tmp / "data"),
        }
        tokens = make_tokens(database_url)
        self.database_url = database_url
        self.operator = tokens.operator
        # Each node speaks with its own credential (`greenflow node enrol NAME`).
        self.node_tokens: dict[str, str] = {"node-1": tokens.agent}
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.api = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.operator}"}, timeout=30
        )

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = (self.tmp / log_name).open("ab")
        return subprocess.Popen(
            [GREENFLOW, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT
        )

    def start_scheduler(self) -> None:
        self.scheduler = self._spawn(["serve"], "scheduler.log")
        # Generous: importing the service took 26 s at load 13 on the shared 2-core machine, and
        # longer while two agents train beside it (a restart waited past 60 s twice).
        wait_http_ok(f"{self.url}/healthz", timeout_s=180, process=self.scheduler)

    def node_token(self, name: str) -> str:
        """The node's own credential, enrolled on first use."""
        if name not in self.node_tokens:
            engine = make_engine(self.database_url)
            with transaction(make_session_factory(engine)) as session:
                self.node_tokens[name] = create_token(session, name=name, role=Role.AGENT)
            engine.dispose()
        return self.node_tokens[name]

    def start_agent(self, name: str, gpus: int) -> None:
        self.agents[name] = self._spawn(
            [
                "agent",
                "--scheduler",
                self.url,
                "--token",
                self.node_token(name),
                "--simulate-gpus",
                str(gpus),
                "--name",
                name,
                # No --checkpoint-dir: checkpoints are on by default, in the data directory
                # both agents of this machine share, so a lost node's jobs resume elsewhere.
                "--checkpoint-interval-s",
                "2",
            ],
            f"agent-{name}.log",
        )

    def kill(self, process: subprocess.Popen[bytes] | None) -> None:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()

    def stop_all(self) -> None:
        for process in [*self.agents.values(), self.scheduler]:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in [*self.agents.values(), self.scheduler]:
            if process is not None:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
        self.api.close()

    def get(self, path: str, **params: Any) -> Any:
        response = self.api.get(path, params=params or None)
        response.raise_for_status()
        return response.json()


@pytest.fixture
def stack(tmp_path: Path, postgres_server: str) -> Iterator[Stack]:
    url, drop = fresh_postgres_database(postgres_server)
    migrate.upgrade(url)
    s = Stack(tmp_path, url)
    try:
        yield s
    finally:
        s.stop_all()
        drop()  # type: ignore[operator]


def describe(stack: Stack) -> str:
    """Every job's state and events, for failure messages."""
    lines = []
    for job in stack.get("/v1/jobs")["items"]:
        lines.append(
            f"job {job['id']} {job['state']} {job['samples_done']} samples: {job['state_reason']}"
        )
        lines += [
            f"    {e['at'][11:19]} {e['kind']} {e['to_state']} {e['reason']}"
            for e in stack.get(f"/v1/jobs/{job['id']}/events")
        ]
    return "\n".join(lines)


def wait_until(what: str, condition: Callable[[], bool], timeout_s: float, stack: Stack) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(1)
    lines = []
    for job in stack.get("/v1/jobs")["items"]:
        lines.append(
            f"job {job['id']} {job['state']} {job['samples_done']} samples: {job['state_reason']}"
        )
        lines += [
            f"    {e['at'][11:19]} {e['kind']} {e['to_state']} {e['reason']}"
            for e in stack.get(f"/v1/jobs/{job['id']}/events")
        ]
    logs = "\n".join(
        f"--- {p.name}\n"
        + "\n".join(
            line
            for line in p.read_text().splitlines()
            if "heartbeat" not in line and "GET /v1" not in line
        )[-4000:]
        for p in stack.tmp.glob("*.log")
    )
    raise AssertionError(
        f"timed out after {timeout_s:.0f} s waiting for {what}\n" + "\n".join(lines) + "\n" + logs
    )


def test_scheduler_drives_real_agents_end_to_end(stack: Stack) -> None:
    stack.start_scheduler()
    stack.start_agent("node-a", 2)
    stack.start_agent("node-b", 2)
    wait_until("two nodes", lambda: len(stack.get("/v1/nodes")) == 2, 90, stack)

    # Two jobs of similar speed that each want a whole node.
    specs = [
        {
            "name": "gpt-a",
            "workload": "gpt-tiny",
            "global_batch_size": 16,
            "total_samples": 40_000,
            "min_gpus": 1,
            "max_gpus": 2,
        },
        {
            "name": "gpt-b",
            "workload": "gpt-tiny",
            "global_batch_size": 16,
            "total_samples": 40_000,
            "min_gpus": 1,
            "max_gpus": 2,
        },
    ]
    job_ids = [stack.api.post("/v1/jobs", json=spec).json()["id"] for spec in specs]

    # Let work start, then kill the scheduler outright and bring it back: nothing is lost.
    wait_until(
        "a job running",
        lambda: any(j["state"] == "RUNNING" for j in stack.get("/v1/jobs")["items"]),
        120,
        stack,
    )
    stack.kill(stack.scheduler)
    time.sleep(3)
    stack.start_scheduler()
    assert sorted(j["id"] for j in stack.get("/v1/jobs")["items"]) == sorted(job_ids)

    # An urgent job on a full cluster: the running jobs are hot-switched down to make room.
    wait_until(
        "both jobs running",
        lambda: all(j["state"] == "RUNNING" for j in stack.get("/v1/jobs")["items"]),
        120,
        stack,
    )
    urgent = {
        "name": "bert",
        "workload": "bert-tiny",
        "global_batch_size": 16,
        "total_samples": 9_600,
        "min_gpus": 1,
        "max_gpus": 2,
        "priority": 100,
    }
    job_ids.append(stack.api.post("/v1/jobs", json=urgent).json()["id"])
    wait_until(
        "a hot switch",
        lambda: any(
            e["kind"] == "hot_switch"
            for j in job_ids[:2]
            for e in stack.get(f"/v1/jobs/{j}/events")
        ),
        90,
        stack,
    )

    # Kill an agent that runs something: its jobs go back to the planner and run elsewhere.
    def running_on(node: str) -> list[int]:
        # Placed there (slots) and acknowledged (RUNNING), not merely planned there.
        nodes = {n["name"]: n for n in stack.get("/v1/nodes")}
        placed = {s["job_id"] for s in nodes[node]["slots"] if s["job_id"] is not None}
        running = {j["id"] for j in stack.get("/v1/jobs")["items"] if j["state"] == "RUNNING"}
        return sorted(placed & running)

    wait_until("work on node-b", lambda: bool(running_on("node-b")), 180, stack)
    victims = running_on("node-b")
    checkpoints = stack.tmp / "data" / "greenflow" / "checkpoints"
    wait_until(
        "a checkpoint of work on node-b",
        lambda: any((checkpoints / f"job-{j}" / "LATEST").is_file() for j in victims),
        60,
        stack,
    )
    stack.kill(stack.agents["node-b"])
    wait_until(
        "node-b marked lost",
        lambda: {n["name"]: n["state"] for n in stack.get("/v1/nodes")}["node-b"] == "lost",
        60,
        stack,
    )
    for job_id in victims:
        reasons = [e["reason"] for e in stack.get(f"/v1/jobs/{job_id}/events")]
        assert any("node-b lost" in r for r in reasons), reasons

    wait_until(
        "every job to finish",
        lambda: all(j["state"] == "SUCCEEDED" for j in stack.get("/v1/jobs")["items"]),
        420,
        stack,
    )

    # A job of the lost node resumed from its checkpoint on the other node, not from step 0.
    resumed = [
        e["details"]
        for job_id in victims
        for e in stack.get(f"/v1/jobs/{job_id}/events")
        if e["kind"] == "allocation"
        and str(e["details"].get("resumed_from", "")).startswith("checkpoint@step")
    ]
    assert resumed and all(d["step"] > 0 for d in resumed), describe(stack)

    # Generations only grow, and each acknowledged command was acknowledged once.
    for job_id in job_ids:
        events = stack.get(f"/v1/jobs/{job_id}/events")
        generations = [
            e["details"]["generation"] for e in events if e["kind"] in ("allocation", "hot_switch")
        ]
        assert generations == sorted(set(generations)), (job_id, generations)

    # At least one hot switch kept its surviving workers (same PIDs) and did not lose steps.
    switches = []
    for job_id in job_ids:
        events = stack.get(f"/v1/jobs/{job_id}/events")
        last_pids: list[int] = []
        last_step = 0
        for event in events:
            if event["kind"] == "allocation":
                last_pids, last_step = event["details"]["worker_pids"], event["details"]["step"]
            elif event["kind"] == "hot_switch":
                details = event["details"]
                switches.append(
                    (
                        job_id,
                        set(last_pids) & set(details["worker_pids"]),
                        details["step"] >= last_step,
                    )
                )
                last_pids, last_step = details["worker_pids"], details["step"]
    assert any(kept and forward for _, kept, forward in switches), describe(stack)

    # Telemetry: the step counter of a job never goes back within one run of its workers.
    for job_id in job_ids:
        samples = stack.get(f"/v1/jobs/{job_id}/telemetry", limit=5000)
        assert samples, f"job {job_id} reported no telemetry"
        assert all(s["power_source"] == "estimated" for s in samples)

    # GPU counts follow the intensity: more GPUs per sample-second in clean hours than dirty.
    carbon = stack.get("/v1/carbon", history_s=3600)["recent"]

    def intensity_at(at: str) -> float:
        moment = datetime.fromisoformat(at)
        known = [p for p in carbon if datetime.fromisoformat(p["at"]) <= moment]
        return known[-1]["intensity_g_per_kwh"] if known else DIRTY_G_PER_KWH

    # The loop reacts within a slot or two (plan, then a hot switch or pause): samples from the
    # first 10 s after the grid changed show the old decision and are left out.
    changes = [
        datetime.fromisoformat(b["at"])
        for a, b in itertools.pairwise(carbon)
        if (a["intensity_g_per_kwh"] < 100) != (b["intensity_g_per_kwh"] < 100)
    ]

    def settled(sample: dict[str, Any]) -> bool:
        start = datetime.fromisoformat(sample["at"]) - timedelta(seconds=sample["interval_s"])
        return not any(timedelta(0) <= start - change < timedelta(seconds=10) for change in changes)

    clean: list[int] = []
    dirty: list[int] = []
    for job_id in job_ids:
        for sample in stack.get(f"/v1/jobs/{job_id}/telemetry", limit=5000):
            if settled(sample):
                (clean if intensity_at(sample["at"]) < 100 else dirty).append(sample["gpus"])
    assert clean, "no work ran in the clean window"
    clean_gpus = sum(clean) / len(clean)
    dirty_gpus = sum(dirty) / len(dirty) if dirty else 0.0
    assert clean_gpus > dirty_gpus, (clean_gpus, dirty_gpus, describe(stack))

    # The ledger stayed within the hard budget.
    budget = stack.get("/v1/budget")
    for period in budget["periods"]:
        assert period["spent_kg_co2e"] <= period["limit_kg_co2e"] + 1e-9, period
    assert budget["total_emissions_kg_co2e"] > 0
