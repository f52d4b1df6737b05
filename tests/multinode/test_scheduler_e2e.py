"""The scheduler runs one job across two nodes: a real `greenflow serve` on the host's loopback,
two `greenflow agent`s each in its own network namespace (198.18.0.0/15, joined by veth links
to a bridge), so the job's own traffic between the nodes crosses real interfaces.

The job starts on node A (2 slots). When node B registers, the scheduler's plan grows it onto
A+B (a hot switch: A's workers keep their processes, B's workers are started by B's worker host
and dial back to A's runner over the link); an urgent job then takes B, and the plan shrinks
the first job back onto A (A's workers still the same processes), training on from the step it
had reached. Scheduler and agents talk through relays (`relay.py`): the agents reach the
scheduler at 127.0.0.1 of their namespace, the scheduler reaches each agent at 127.0.0.1 of the
host. Skipped, with the reason, where namespaces cannot be created (not root, no iproute2).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from bench.netns import Network, network, unavailable
from scheduler_service.auth.service import create_token
from scheduler_service.auth.tokens import Role
from scheduler_service.db import migrate
from scheduler_service.db.models import Allocation
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from tests.api.conftest import make_tokens
from tests.e2e.test_end_to_end import write_hourly_trace
from tests.multinode.relay import Relay
from tests.support.processes import GREENFLOW, free_port, running

WHY_NOT = unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(WHY_NOT is not None, reason=f"multi-node tests skipped: {WHY_NOT}"),
]

CONFIG = """\
[budget]
period = "day"
limit_kg_co2e = 1000
[carbon]
provider = "trace"
region = "multinode"
trace_path = "{trace}"
forecast_mode = "oracle"
[planner]
slot_s = 5
horizon_s = 100
solver_time_limit_s = 2.0
[cluster]
heartbeat_timeout_s = {heartbeat_timeout_s}
agent_heartbeat_interval_s = 1
agent_telemetry_interval_s = 1
"""
HEARTBEAT_TIMEOUT_S = 60
"""Generous: a node declared lost on a loaded machine would re-queue the job mid-test (a test
that kills a node passes a shorter one as the fixture's parameter)."""
AGENT_PORT = 9100
"""Each agent's API port inside its own namespace."""


class Cluster:
    """The scheduler on loopback, the nodes' namespaces, relays and agents."""

    def __init__(self, tmp: Path, net: Network, url: str, port: int, tokens: dict[str, str]):
        self.tmp, self.net, self.url, self.port, self.tokens = tmp, net, url, port, tokens
        self.api = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {tokens['operator']}"}, timeout=30
        )
        self.relays: list[Relay] = []

    def start_agent(self, node: str) -> None:
        """Relays for `node`, then its agent inside its namespace (2 simulated slots)."""
        netns = self.net.nodes[node].netns
        self.relays.append(Relay(netns, self.port, None, self.port))  # agent -> scheduler
        inbound = Relay(None, 0, netns, AGENT_PORT)  # scheduler -> agent
        self.relays.append(inbound)
        log = (self.tmp / f"agent-{node}.log").open("w")
        argv = [
            GREENFLOW, "agent", "--scheduler", self.url, "--simulate-gpus", "2",
            "--name", node, "--port", str(AGENT_PORT),
            "--advertise-url", f"http://127.0.0.1:{inbound.port}",
            "--rendezvous-host", self.net.nodes[node].address,
            "--checkpoint-dir", str(self.tmp / "checkpoints"), "--checkpoint-interval-s", "10",
            "--data-dir", str(self.tmp / f"data-{node}"),
        ]  # fmt: skip
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "GREENFLOW_AGENT_TOKEN": self.tokens[node]},
        )
        self.net.procs.append(proc)

    def get(self, path: str) -> Any:
        response = self.api.get(path)
        response.raise_for_status()
        return response.json()

    def submit(self, spec: dict[str, Any]) -> int:
        response = self.api.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    def placement(self, job_id: int) -> dict[str, list[int]]:
        """The slots the scheduler gives the job, by node name."""
        out: dict[str, list[int]] = {}
        for node in self.get("/v1/nodes"):
            held = [s["index"] for s in node["slots"] if s["job_id"] == job_id]
            if held:
                out[node["name"]] = held
        return out

    def set_gpu_range(self, job_id: int, min_gpus: int, max_gpus: int) -> None:
        """The operator's GPU range for the job (the next plan keeps within it)."""
        body = {"min_gpus": min_gpus, "max_gpus": max_gpus}
        response = self.api.post(f"/v1/jobs/{job_id}/gpus", json=body)
        assert response.status_code == 200, response.text

    def events(self, job_id: int, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.get(f"/v1/jobs/{job_id}/events") if e["kind"] == kind]

    def wait(self, what: str, condition: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.5)
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.tmp.glob("*.log"))
        )
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")

    def close(self) -> None:
        self.api.close()
        for relay in self.relays:
            relay.close()


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """The scheduler and two nodes' namespaces; `request.param`: the heartbeat timeout (s)."""
    timeout_s = float(getattr(request, "param", HEARTBEAT_TIMEOUT_S))
    url = f"sqlite:///{tmp_path / 'greenflow.db'}"
    migrate.upgrade(url)
    base = make_tokens(url)
    engine = make_engine(url)
    with transaction(make_session_factory(engine)) as session:
        nodes = {n: create_token(session, name=n, role=Role.AGENT) for n in ("h3a", "h3b")}
    engine.dispose()
    trace = tmp_path / "trace.csv"
    write_hourly_trace(trace, lambda hour: 50.0)
    config = tmp_path / "greenflow.toml"
    config.write_text(CONFIG.format(trace=trace, heartbeat_timeout_s=timeout_s))
    port = free_port()
    env = {
        "GREENFLOW_DATABASE_URL": url,
        "GREENFLOW_CONFIG": str(config),
        "GREENFLOW_PORT": str(port),
        "GREENFLOW_SECRET_KEY": secrets.token_urlsafe(48),
    }
    server = f"http://127.0.0.1:{port}"
    with (
        running(["serve"], env, tmp_path / "serve.log", health_url=f"{server}/healthz"),
        network(["h3a", "h3b"], prefix="h3") as net,
    ):
        c = Cluster(tmp_path, net, server, port, {"operator": base.operator, **nodes})
        try:
            yield c
        finally:
            for proc in net.procs:  # SIGTERM first: agents release their workers
                if proc.poll() is None:
                    proc.terminate()
            for proc in net.procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            c.close()


def _spanning_job(c: Cluster) -> tuple[int, dict[str, Any], list[int], dict[str, Any]]:
    """Node A, a 2-4 GPU job on its two slots, then node B: the plan grows the job onto A+B.
    Returns the job, node A, A's worker pids and the grow's event details."""
    c.start_agent("h3a")
    c.wait("node h3a", lambda: [n["name"] for n in c.get("/v1/nodes")] == ["h3a"], 120)
    (node_a,) = c.get("/v1/nodes")
    assert node_a["rendezvous_host"] == c.net.nodes["h3a"].address
    assert node_a["worker_host_port"]

    big = c.submit(
        {
            "name": "big", "workload": "mlp", "global_batch_size": 16,
            "total_samples": 16 * 1_000_000, "min_gpus": 2, "max_gpus": 4,
        }
    )  # fmt: skip
    c.wait("the job on node A's two slots", lambda: c.placement(big) == {"h3a": [0, 1]}, 180)
    c.wait("the job started", lambda: bool(c.events(big, "allocation")), 120)
    (started,) = c.events(big, "allocation")
    pids_a = started["details"]["worker_pids"]
    assert len(pids_a) == 2

    # Node B comes and the operator asks for 4 GPUs (more than A has): the plan grows the job
    # onto A+B, a hot switch across the link. (Left to itself, the planner's fitted model may
    # show this CPU job no faster on 4 slots and keep it on A: a quiet machine did, for 300 s.)
    c.start_agent("h3b")
    c.wait("node h3b", lambda: len(c.get("/v1/nodes")) == 2, 120)
    c.set_gpu_range(big, 4, 4)
    c.wait(
        "the job on both nodes",
        lambda: (
            set(c.placement(big)) == {"h3a", "h3b"}
            and bool(c.events(big, "hot_switch"))
            and c.get(f"/v1/jobs/{big}")["current_gpus"] >= 3
        ),
        300,
    )
    (grow,) = c.events(big, "hot_switch")
    details = grow["details"]
    assert details["from_gpus"] == 2 and details["to_gpus"] >= 3
    assert details["step"] >= started["details"]["step"]
    # A's workers kept their processes; the new ones run on B (other processes).
    assert set(pids_a) <= set(details["worker_pids"])
    assert len(set(details["worker_pids"])) == details["to_gpus"]
    assert c.placement(big)["h3a"] == [0, 1]
    return big, node_a, pids_a, details


def test_the_scheduler_grows_a_job_onto_a_second_node_and_shrinks_it_back(
    cluster: Cluster,
) -> None:
    c = cluster
    big, node_a, pids_a, details = _spanning_job(c)

    # An urgent deadline job needs two slots of the full cluster: the plan shrinks the first job
    # back onto A.
    due = (datetime.now(UTC) + timedelta(minutes=20)).isoformat()
    urgent = c.submit(
        {
            "name": "urgent", "workload": "mlp", "global_batch_size": 16,
            "total_samples": 16 * 200, "min_gpus": 2, "max_gpus": 2, "priority": 100,
            "deadline": due,
        }
    )  # fmt: skip
    c.set_gpu_range(big, 2, 4)  # the first job may run on fewer GPUs again
    c.wait(
        "the first job back on node A",
        lambda: c.placement(big) == {"h3a": [0, 1]} and len(c.events(big, "hot_switch")) >= 2,
        300,
    )
    shrink = c.events(big, "hot_switch")[1]["details"]
    assert shrink["to_gpus"] == 2 and shrink["step"] >= details["step"]
    assert sorted(shrink["worker_pids"]) == sorted(pids_a)
    c.wait("the urgent job on node B", lambda: c.placement(urgent) == {"h3b": [0, 1]}, 300)
    c.wait(
        "the urgent job done",
        lambda: c.get(f"/v1/jobs/{urgent}")["state"] == "SUCCEEDED",
        300,
    )
    # The first job trained on from where it was, never restarted.
    c.wait(
        "the first job past the shrink",
        lambda: c.get(f"/v1/jobs/{big}")["step"] > shrink["step"],
        120,
    )
    assert len(c.events(big, "allocation")) == 1
    # With the urgent job done its 2 GPUs are free again, and its range (2-4) lets the next
    # plan grow it back: a further hot switch, not a restart (a CI run caught it RESIZING).
    job = c.get(f"/v1/jobs/{big}")
    assert job["state"] in ("RUNNING", "RESIZING") and job["current_gpus"] >= 2
    # Its telemetry came from A (the runner's node), for all its GPUs while it spanned.
    samples = c.get(f"/v1/jobs/{big}/telemetry")
    assert {s["node_id"] for s in samples} == {node_a["id"]}
    assert max(s["gpus"] for s in samples) >= details["to_gpus"]
    assert c.api.post(f"/v1/jobs/{big}/cancel").status_code == 200


def test_a_spanning_job_whose_second_node_dies_goes_on_on_the_first(cluster: Cluster) -> None:
    c = cluster
    big, _, _, details = _spanning_job(c)
    latest = c.tmp / "checkpoints" / f"job-{big}" / "LATEST"

    def checkpointed_step() -> int:
        text = latest.read_text().strip() if latest.is_file() else ""
        return int(text.removeprefix("step-")) if text.startswith("step-") else -1

    # Every 10 s: one written while the job spans both nodes (its workers on B write theirs).
    c.wait("a checkpoint since the grow", lambda: checkpointed_step() > details["step"], 120)
    killed_at = time.monotonic()
    assert c.net.kill_node("h3b")  # agent B and B's workers, SIGKILL; the link stays up

    def reasons() -> str:
        return " ".join(e["reason"] for e in c.get(f"/v1/jobs/{big}/events"))

    # The job's events say which node went (from the runner's node's report, before B's
    # heartbeats time out); then the operator lets it run on what node A alone holds.
    c.wait("the loss reported", lambda: "workers on node(s) h3b lost" in reasons(), 300)
    c.set_gpu_range(big, 2, 4)
    c.wait(
        "the job running again on node A alone",
        lambda: (
            c.placement(big) == {"h3a": [0, 1]}
            and len(c.events(big, "allocation")) >= 2
            and c.get(f"/v1/jobs/{big}")["state"] == "RUNNING"
        ),
        300,
    )
    lost_after_s = time.monotonic() - killed_at
    restart = c.events(big, "allocation")[-1]["details"]
    # Resumed from a checkpoint written while it spanned, not from step 0.
    assert str(restart["resumed_from"]).startswith("checkpoint@step"), restart
    assert restart["step"] > details["step"]
    c.wait(
        "training past the restart",
        lambda: c.get(f"/v1/jobs/{big}")["step"] > restart["step"],
        120,
    )
    print(f"node B killed: the job ran again on A {lost_after_s:.0f} s later, from {restart}")
    assert c.api.post(f"/v1/jobs/{big}/cancel").status_code == 200


RUNNER_LOST_TIMEOUT_S = 20
"""The heartbeat timeout of the runner-lost test: short, so the test is (agents beat every
1 s, so 20 s of silence is a dead node even on a loaded machine)."""


@pytest.mark.parametrize("cluster", [RUNNER_LOST_TIMEOUT_S], indirect=True)
def test_a_spanning_job_whose_runner_node_dies_restarts_on_the_other_from_a_checkpoint(
    cluster: Cluster,
) -> None:
    # Node A holds the job's runner: its rank 0 and its rendezvous store. SIGKILL of A's agent
    # and workers leaves B's workers without their runner; the tick that finds A's heartbeats
    # timed out re-queues the job, frees B's slots with A's, and starts it on B as its own
    # runner from the newest checkpoint in the shared directory.
    c = cluster
    big, _, pids_a, details = _spanning_job(c)
    pids_b = set(details["worker_pids"]) - set(pids_a)
    latest = c.tmp / "checkpoints" / f"job-{big}" / "LATEST"

    def checkpointed_step() -> int:
        text = latest.read_text().strip() if latest.is_file() else ""
        return int(text.removeprefix("step-")) if text.startswith("step-") else -1

    c.wait("a checkpoint since the grow", lambda: checkpointed_step() > details["step"], 120)
    assert c.net.kill_node("h3a")  # agent A, the runner and A's workers, SIGKILL
    killed_at = datetime.now(UTC)
    time.sleep(1)  # A's last telemetry, if any was on its way, is in
    samples_at_kill = c.get(f"/v1/jobs/{big}")["samples_done"]
    # Only once A is found lost may the job run on what B alone holds: a range of 2-4 set at the
    # kill let a tick in the 20 s before shrink it onto A, the dead runner's node (a CI run
    # caught it RESIZING there, B's slots already given up).
    c.wait(
        "node A found lost",
        lambda: any("node h3a lost" in e["reason"] for e in c.get(f"/v1/jobs/{big}/events")),
        120,
    )
    c.set_gpu_range(big, 2, 4)
    c.wait(
        "the job running again on node B alone",
        lambda: (
            c.placement(big) == {"h3b": [0, 1]}
            and len(c.events(big, "allocation")) >= 2
            and c.get(f"/v1/jobs/{big}")["state"] == "RUNNING"
        ),
        300,
    )
    events = c.get(f"/v1/jobs/{big}/events")
    (lost,) = [e for e in events if "node h3a lost" in e["reason"]]
    assert lost["to_state"] == "QUEUED", lost
    assert f"no heartbeat for {RUNNER_LOST_TIMEOUT_S} s" in lost["reason"], lost
    # It says what went with A: the job's runner; and which GPUs elsewhere were given up.
    assert "its runner (and rendezvous store) was there" in lost["reason"], lost
    assert lost["details"] == {
        "node": "h3a", "runner_lost": True, "runner_node": "h3a", "freed": {"h3b": [0, 1]},
    }  # fmt: skip
    restart = c.events(big, "allocation")[-1]["details"]
    # Resumed from a checkpoint written while it spanned, not from step 0; what it had trained
    # since is redone, and the event says how much.
    assert str(restart["resumed_from"]).startswith("checkpoint@step"), restart
    assert restart["step"] > details["step"] and restart["gpus"] == 2
    assert restart["samples_lost"] == max(0, samples_at_kill - 16 * restart["step"]), restart
    # B's workers of the old run left with their runner (so B's slots were free to start on).
    assert not pids_b & set(restart["worker_pids"])
    assert not [pid for pid in pids_b if Path(f"/proc/{pid}").exists()], pids_b
    # When the start on B was sent after A was found lost (the same-tick restart of a job whose
    # runner's node is lost is tests/service/test_node_lost_replan.py's; here the range change
    # after the loss lets it start).
    lost_at = datetime.fromisoformat(lost["at"])
    engine = make_engine(f"sqlite:///{c.tmp / 'greenflow.db'}")
    try:
        with transaction(make_session_factory(engine)) as session:
            command = session.scalars(
                select(Allocation).where(Allocation.generation == restart["generation"])
            ).one()
            sent_s = (command.created_at - lost_at).total_seconds()
            acked_at = command.acked_at
    finally:
        engine.dispose()
    assert sent_s > 0, sent_s
    lost_s = (lost_at - killed_at).total_seconds()
    # Found lost at the first tick after the timeout (ticks every 5 s; the load may delay it).
    assert RUNNER_LOST_TIMEOUT_S - 2 <= lost_s <= RUNNER_LOST_TIMEOUT_S + 2 * 5 + 10, lost_s
    c.wait(
        "training past the restart",
        lambda: c.get(f"/v1/jobs/{big}")["step"] > restart["step"],
        120,
    )
    assert acked_at is not None
    print(
        f"runner node A killed: found lost {lost_s:.1f} s later; start on B sent {sent_s:.2f} s "
        f"after that, running {(acked_at - lost_at).total_seconds():.1f} s after it, from "
        f"{restart['resumed_from']}, {restart['samples_lost']} samples redone"
    )
    assert c.api.post(f"/v1/jobs/{big}/cancel").status_code == 200
