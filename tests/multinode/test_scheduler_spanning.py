"""The scheduler's side of a job across nodes, without namespaces: a job that needs more GPUs
than one node has is placed on two nodes that advertised a rendezvous address, its command
names the other node's part, and its telemetry is accepted from its runner's node only."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from scheduler_service.app import create_app
from scheduler_service.auth.service import Principal
from scheduler_service.auth.tokens import Role
from scheduler_service.control_loop import ControlLoop
from scheduler_service.db.models import Allocation, GpuSlot, Job, Node
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.service import deliveries, record_ack, tp_degree
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.nodes.secrets import NodeSecrets
from scheduler_service.nodes.service import heartbeat
from scheduler_service.settings import GreenflowConfig, Settings
from scheduler_service.telemetry.service import Rejection, TelemetryLimits, ingest
from tests.api.conftest import auth, database_url, make_tokens, postgres_server  # noqa: F401
from tests.service.test_budget_watchdog import _config
from worker_agent.protocol import (
    AllocationAck,
    AllocationCommand,
    Heartbeat,
    NodePowerSample,
    NodeRegistered,
    PowerReading,
    TelemetryReport,
    TelemetrySample,
    worker_grant,
)

LIMITS = TelemetryLimits(max_power_per_gpu_w=700.0, rate_factor=3.0, grace_s=30.0)


def _nodes(
    factory: sessionmaker[Session], key_id: str, *, spannable: bool, silent_b_s: float = 0.0
) -> dict[str, int]:
    """Nodes a and b with 4 slots each; with `spannable`, each advertised a rendezvous address;
    b's last heartbeat `silent_b_s` ago."""
    ids: dict[str, int] = {}
    with transaction(factory) as session:
        for i, name in enumerate(("a", "b")):
            node = Node(
                name=name,
                agent_url=f"http://127.0.0.1:{9 + i}",
                last_heartbeat_at=datetime.now(UTC) - timedelta(seconds=silent_b_s * i),
                secret_key_id=key_id,
                agent_secret_nonce="nonce",
                rendezvous_host=f"198.18.0.{2 + i}" if spannable else None,
                worker_host_port=7000 + i if spannable else None,
            )
            session.add(node)
            session.flush()
            session.add_all(GpuSlot(node_id=node.id, index=k) for k in range(4))
            ids[name] = node.id
    return ids


def _big_job(factory: sessionmaker[Session]) -> int:
    """A queued job that needs 6 GPUs, due soon (the planner must run it now, on 6-8 GPUs)."""
    now = datetime.now(UTC)
    with transaction(factory) as session:
        job = Job(
            owner="alice", name="big", workload="resnet50", global_batch_size=256,
            total_samples=10**7, min_gpus=6, max_gpus=8, state=JobState.QUEUED.value,
            state_reason="queued", created_at=now, updated_at=now,
            deadline_at=now + timedelta(hours=3),
        )  # fmt: skip
        session.add(job)
        session.flush()
        return job.id


def _tick(loop: ControlLoop) -> None:
    async def run() -> None:
        try:
            await loop.tick()  # the agents' URLs answer nothing: commands stay unacknowledged
        finally:
            await loop.agents.aclose()
            await loop.carbon.aclose()

    asyncio.run(run())


def test_a_job_larger_than_any_node_spans_nodes_that_reach_each_other(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    loop = ControlLoop(_config(limit_kg=1000.0), factory, engine)
    nodes = _nodes(factory, loop.node_secrets.key_id, spannable=True)
    job_id = _big_job(factory)
    try:
        _tick(loop)
        with transaction(factory) as session:
            allocation = session.scalars(
                select(Allocation).where(Allocation.job_id == job_id)
            ).one()
            held = {
                (s.node_id, s.index)
                for s in session.scalars(select(GpuSlot).where(GpuSlot.job_id == job_id))
            }
            assert allocation.gpus >= 6
            assert allocation.parts, "a 6+ GPU job on 4-GPU nodes must have a part elsewhere"
            assert allocation.node_id is not None
            own, (other, other_slots) = allocation.node_id, allocation.parts[0]
            assert {own, other} == set(nodes.values())
            # The database holds exactly the placed slots, on both nodes.
            assert held == {(own, i) for i in allocation.slot_indices} | {
                (other, i) for i in other_slots
            }
            assert len(held) == allocation.gpus
            # The command goes to the runner's node and names the other node's part.
            (delivery,) = deliveries(session, loop.node_secrets)
            command = delivery.command
            assert isinstance(command, AllocationCommand)
            other_name = "a" if other == nodes["a"] else "b"
            assert delivery.agent_url.endswith(str(9 if own == nodes["a"] else 10))
            assert [(p.node, p.host, p.port, p.slot_indices) for p in command.remote] == [
                (
                    other_name,
                    "198.18.0.2" if other_name == "a" else "198.18.0.3",
                    7000 if other_name == "a" else 7001,
                    list(other_slots),
                )
            ]
            assert command.slot_indices == allocation.slot_indices
            # The part's grant is the other node's to check (from its own secret), scoped to
            # this job and this runner node: no key shared by the cluster.
            other_secret = loop.node_secrets.agent_secret(other, other_name, "nonce")
            own_name = "a" if own == nodes["a"] else "b"
            assert command.remote[0].grant == worker_grant(other_secret, job_id, own_name)
            assert command.remote[0].grant != worker_grant(other_secret, job_id + 1, own_name)
            # Acknowledged: the runner's node reports for all the job's GPUs; the other node's
            # samples for it are refused (it does not run the job's runner), so nothing counts
            # twice.
            record_ack(
                session,
                delivery.allocation_id,
                AllocationAck(
                    job_id=job_id, generation=1, gpus=allocation.gpus, layout="dp8-tp1-pp1",
                    step=0, worker_pids=list(range(allocation.gpus)),
                ),
            )  # fmt: skip
            names = {v: k for k, v in nodes.items()}
            gpus = allocation.gpus

        def sample(sid: str) -> TelemetrySample:
            return TelemetrySample(
                sample_id=sid, job_id=job_id, generation=1, at=datetime.now(UTC),
                interval_s=1.0, step=1, samples_done=256, samples_per_s=256.0, gpus=gpus,
                layout="dp8-tp1-pp1", power_w=150.0 * gpus, energy_kwh=150.0 * gpus / 3.6e6,
                power_source="estimated",
            )  # fmt: skip

        with transaction(factory) as session:
            runner = ingest(session, names[own], TelemetryReport(samples=[sample("s1")]), LIMITS)
        with transaction(factory) as session:
            member = ingest(session, names[other], TelemetryReport(samples=[sample("s2")]), LIMITS)
        assert (runner.stored, runner.rejected_count) == (1, 0)
        assert (member.stored, member.rejected) == (0, {Rejection.NOT_PLACED_HERE: [job_id]})
        # The other node's power readings may name the job on the slots it holds there.
        reading = PowerReading(
            component="gpu", device=str(other_slots[0]), job_id=job_id, energy_j=100.0,
            source="nvml",
        )  # fmt: skip
        power = NodePowerSample(
            sample_id="np-1", at=datetime.now(UTC), interval_s=1.0, readings=[reading]
        )
        with transaction(factory) as session:
            named = ingest(
                session, names[other], TelemetryReport(samples=[], node_power=[power]), LIMITS
            )
        assert (named.node_power_stored, named.node_power_rejected) == (1, {})
    finally:
        engine.dispose()


def test_without_rendezvous_addresses_a_job_stays_inside_one_node(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    loop = ControlLoop(_config(limit_kg=1000.0), factory, engine)
    _nodes(factory, loop.node_secrets.key_id, spannable=False)
    job_id = _big_job(factory)
    try:
        _tick(loop)
        with transaction(factory) as session:
            assert not list(session.scalars(select(Allocation).where(Allocation.job_id == job_id)))
            job = session.get(Job, job_id)
            assert job is not None and job.state == JobState.QUEUED.value
    finally:
        engine.dispose()


def test_registration_stores_the_rendezvous_address_and_hands_out_no_cluster_key(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    tokens = make_tokens(database_url)
    app = create_app(Settings(database_url=database_url, run_control_loop=False), GreenflowConfig())
    body = {
        "name": "node-1",
        "agent_url": "http://127.0.0.1:9",
        "slots": [{"index": 0}],
        "rendezvous_host": "198.18.0.2",
        "worker_host_port": 7000,
    }
    with TestClient(app) as client:
        answer = client.post("/v1/nodes/register", json=body, headers=auth(tokens.agent))
        assert answer.status_code == 200, answer.text
        registered = NodeRegistered.model_validate(answer.json())
        again = NodeRegistered.model_validate(
            client.post("/v1/nodes/register", json=body, headers=auth(tokens.agent)).json()
        )
        listed = client.get("/v1/nodes", headers=auth(tokens.operator)).json()
        bad = client.post(
            "/v1/nodes/register",
            json=body | {"rendezvous_host": "198.18.0.2; rm"},
            headers=auth(tokens.agent),
        )
    app.state.engine.dispose()
    # Only the node's own secret, new at every registration (grants to it derive from it).
    assert set(NodeRegistered.model_fields) == set(answer.json())
    assert "worker_host_key" not in answer.json()
    assert registered.agent_secret != again.agent_secret
    assert [(n["rendezvous_host"], n["worker_host_port"]) for n in listed] == [("198.18.0.2", 7000)]
    assert bad.status_code == 422 and "rendezvous_host" in bad.text


def test_tp_degree_of_a_layout_label() -> None:
    assert [tp_degree(x) for x in ("dp2-tp4-pp1", "dp8-tp1-pp1", None, "odd")] == [4, 1, 1, 1]


def test_a_job_whose_command_its_node_refused_and_that_runs_nowhere_goes_back_to_the_queue(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # Seen across nodes: the job's workers died (its other node was killed) while the next
    # command was on its way; the agent refused it (the job had failed there) and reported the
    # job as not running. Before, nothing re-queued it: it held its slots for good.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    secrets = NodeSecrets.generate()
    nodes = _nodes(factory, secrets.key_id, spannable=True)
    job_id = _big_job(factory)
    with transaction(factory) as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.state = JobState.RUNNING.value
        for generation, status in ((1, "acked"), (2, "rejected")):
            session.add(
                Allocation(
                    job_id=job_id, generation=generation, node_id=nodes["a"], gpus=4,
                    slot_indices=[0, 1], parts=[[nodes["b"], [0, 1]]], status=status,
                )
            )  # fmt: skip
        NodeRepository(session).assign_parts([(nodes["a"], [0, 1]), (nodes["b"], [0, 1])], job_id)
    principal = Principal(name="a", role=Role.AGENT, token_id="t")
    try:
        with transaction(factory) as session:
            heartbeat(session, principal, "a", Heartbeat(jobs=[]), key_id=secrets.key_id)
        with transaction(factory) as session:
            job = session.get(Job, job_id)
            assert job is not None and job.state == JobState.QUEUED.value
            held = session.scalars(select(GpuSlot).where(GpuSlot.job_id == job_id))
            assert list(held) == []
    finally:
        engine.dispose()


def test_a_job_does_not_span_onto_a_node_silent_for_three_heartbeats(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # Heartbeats every 5 s (the default): b, silent for 20 s, still counts as ready (the
    # timeout is 30 s) but a job is not spread onto it.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    loop = ControlLoop(_config(limit_kg=1000.0), factory, engine)
    _nodes(factory, loop.node_secrets.key_id, spannable=True, silent_b_s=20.0)
    job_id = _big_job(factory)
    try:
        _tick(loop)
        with transaction(factory) as session:
            assert not list(session.scalars(select(Allocation).where(Allocation.job_id == job_id)))
            job = session.get(Job, job_id)
            assert job is not None and job.state == JobState.DEFERRED.value
            assert job.state_reason.startswith("placement:"), job.state_reason
    finally:
        engine.dispose()
