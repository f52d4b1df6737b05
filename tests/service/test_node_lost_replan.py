"""A job across nodes that lost one of them is planned again at once (issue 20): the runner's
node reports that it went on alone from the replicas, the heartbeat asks the loop for a tick,
and that one tick grows the job back to its count onto a surviving node with free GPUs, not onto
the node it lost; a job whose runner's node is lost is re-queued and restarted on the node left
in the tick that marks the node lost."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler_service.auth.service import Principal
from scheduler_service.auth.tokens import Role
from scheduler_service.control_loop import ControlLoop, TickReport
from scheduler_service.db.models import Allocation, GpuSlot, Job, JobEvent
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.nodes.secrets import NodeSecrets
from scheduler_service.nodes.service import heartbeat, mark_lost_nodes
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.service.test_budget_watchdog import _config
from tests.support.fake_agent import FakeAgent, serving
from tests.support.rows import add_node
from worker_agent.protocol import Heartbeat, RunningJob


@pytest.mark.parametrize("silent_b_s", [20, 2])
def test_a_job_that_lost_a_node_grows_back_onto_a_free_surviving_node_in_one_tick(
    database_url: str,  # noqa: F811 (fixture)
    silent_b_s: int,
) -> None:
    # Nodes a, b, c (2 GPUs each, all with a rendezvous address). The job runs on a (its
    # runner) and b, 4 GPUs; b was last heard from `silent_b_s` ago (20: silent for more than
    # three 5 s heartbeats; 2: it still looks fresh), not yet past the 30 s timeout. a reports
    # that the job went on alone on its 2 GPUs: b is not chosen again either way.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    secrets = NodeSecrets.generate()
    now = datetime.now(UTC)
    agent_a = FakeAgent("a", steps={}, running=set())
    with serving(agent_a):
        with transaction(factory) as session:
            nodes, job_id = _wide_job_on_a_and_b(
                session,
                {
                    "a": (agent_a.url, now),
                    "b": ("http://127.0.0.1:9", now - timedelta(seconds=silent_b_s)),
                    "c": ("http://127.0.0.1:9", now),
                },
                secrets,
                now,
            )
        agent_a.steps[job_id] = 121
        agent_a.running.add(job_id)
        alone = RunningJob(
            job_id=job_id, generation=1, gpus=2, slot_indices=[0, 1], layout="dp2-tp1-pp1",
            step=121, samples_done=121 * 256, worker_pids=[11, 12], lost_nodes=["b"],
        )  # fmt: skip
        replans: list[str] = []
        with transaction(factory) as session:
            principal = Principal(name="a", role=Role.AGENT, token_id="t")
            heartbeat(
                session, principal, "a", Heartbeat(jobs=[alone]), key_id=secrets.key_id,
                replan=lambda: replans.append("a"),
            )  # fmt: skip
        assert replans == ["a"]

        async def one_tick() -> TickReport:
            loop = ControlLoop(_config(limit_kg=1000.0), factory, engine, policy="static",
                               node_secrets=secrets)  # fmt: skip
            try:
                return await loop.tick()
            finally:
                await loop.agents.aclose()

        try:
            report = asyncio.run(one_tick())
            assert (report.commands, report.acked) == (1, 1)
            (command,) = agent_a.commands
            # Grown back to 4: a's two GPUs and c's two, not the lost b's.
            assert (command.generation, command.slot_indices) == (2, [0, 1])
            assert [(p.node, p.slot_indices) for p in command.remote] == [("c", [0, 1])]
            with transaction(factory) as session:
                held = sorted(
                    (s.node_id, s.index)
                    for s in session.scalars(select(GpuSlot).where(GpuSlot.job_id == job_id))
                )
                assert held == [(nodes["a"], 0), (nodes["a"], 1), (nodes["c"], 0), (nodes["c"], 1)]
                row = session.get(Job, job_id)
                assert row is not None
                assert (row.state, row.current_gpus) == (JobState.RUNNING.value, 4)
                kinds = [
                    (e.kind, e.reason)
                    for e in session.scalars(
                        select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
                    )
                ]
                lost = [reason for kind, reason in kinds if kind == "node_lost"]
                assert len(lost) == 1 and "node(s) b lost" in lost[0], kinds
                # Growing back is a hot switch of the job's runner, at the step it reached.
                after = [kind for kind, _ in kinds[[k for k, _ in kinds].index("node_lost") :]]
                assert "hot_switch" in after, kinds
        finally:
            engine.dispose()


def test_a_job_whose_runner_node_is_lost_restarts_on_its_surviving_node_in_the_same_tick(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # The job runs on a (its runner) and b, 2 GPUs each; a's heartbeats stopped 60 s ago (the
    # timeout is 30 s). The tick that marks a lost re-queues the job, frees its slots on b too,
    # and plans it at once: a start on b, the node left, from the newest checkpoint (as b's
    # agent answers here). Before, the job kept b's slots and the plan, placing it where it sat,
    # sent no command: it stayed queued.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    secrets = NodeSecrets.generate()
    now = datetime.now(UTC)
    agent_b = FakeAgent("b")
    with serving(agent_b):
        with transaction(factory) as session:
            _, job_id = _wide_job_on_a_and_b(
                session,
                {
                    "a": ("http://127.0.0.1:9", now - timedelta(seconds=60)),
                    "b": (agent_b.url, now),
                },
                secrets,
                now,
            )
        agent_b.steps[job_id] = 100  # the newest checkpoint, written at step 100

        async def one_tick() -> TickReport:
            # Elastic (the static policy would wait for the job's largest count, 4).
            loop = ControlLoop(_config(limit_kg=1000.0), factory, engine,
                               policy="carbon-agnostic", node_secrets=secrets)  # fmt: skip
            try:
                return await loop.tick()
            finally:
                await loop.agents.aclose()

        try:
            report = asyncio.run(one_tick())
            assert (report.commands, report.acked) == (1, 1)
            (command,) = agent_b.commands
            assert (command.generation, command.slot_indices, command.remote) == (2, [0, 1], [])
            with transaction(factory) as session:
                row = session.get(Job, job_id)
                assert row is not None
                assert (row.state, row.current_gpus, row.step) == (JobState.RUNNING.value, 2, 100)
                events = list(
                    session.scalars(
                        select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
                    )
                )
                reasons = [e.reason for e in events]
                # The event says what the node took with it: the job's runner, and which of
                # its GPUs elsewhere were freed.
                (lost,) = [e for e in events if e.reason.startswith("node a lost")]
                assert lost.reason == (
                    "node a lost (no heartbeat for 30 s); its runner (and rendezvous store) was "
                    "there: its GPUs elsewhere (2 on node b) are freed and it is placed again "
                    "(its start says from which checkpoint)"
                )
                assert lost.details == {
                    "node": "a", "runner_lost": True, "runner_node": "a", "freed": {"b": [0, 1]},
                }  # fmt: skip
                assert any("resumed from checkpoint at step100" in r for r in reasons), reasons
        finally:
            engine.dispose()


def _wide_job_on_a_and_b(
    session: Session,
    heard: dict[str, tuple[str, datetime]],
    secrets: NodeSecrets,
    now: datetime,
) -> tuple[dict[str, int], int]:
    """Nodes named as `heard` (agent URL, last heartbeat; 2 GPUs each, with rendezvous
    addresses) and one 4-GPU job running on a (its runner) and b, acknowledged: (node ids by
    name, the job's id)."""
    nodes: dict[str, int] = {}
    for i, (name, (url, last_heard)) in enumerate(heard.items()):
        nodes[name] = add_node(
            session, name, 2, agent_url=url, last_heartbeat_at=last_heard,
            secret_key_id=secrets.key_id, agent_secret_nonce="nonce",
            rendezvous_host=f"198.18.0.{2 + i}", worker_host_port=7000 + i,
        ).id  # fmt: skip
    job = Job(
        owner="alice", name="wide", workload="resnet50", global_batch_size=256,
        total_samples=10**9, samples_done=120 * 256, step=120, min_gpus=2, max_gpus=4,
        state=JobState.RUNNING.value, state_reason="running", created_at=now,
        updated_at=now, current_gpus=4, current_layout="dp4-tp1-pp1",
    )  # fmt: skip
    session.add(job)
    session.flush()
    session.add(
        Allocation(
            job_id=job.id, generation=1, node_id=nodes["a"], gpus=4, slot_indices=[0, 1],
            parts=[[nodes["b"], [0, 1]]], status="acked",
        )
    )  # fmt: skip
    NodeRepository(session).assign_parts([(nodes["a"], [0, 1]), (nodes["b"], [0, 1])], job.id)
    return nodes, job.id


def test_a_lost_member_node_frees_the_jobs_gpus_elsewhere_and_names_its_runner(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # b, the job's other node, times out while the job still holds slots there (its runner
    # on a never reported going on alone): the job is re-queued, a's slots freed too, and the
    # event says the part on b was lost and the runner was on a.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    secrets = NodeSecrets.generate()
    now = datetime.now(UTC)
    try:
        with transaction(factory) as session:
            _, job_id = _wide_job_on_a_and_b(
                session,
                {"a": ("http://127.0.0.1:9", now), "b": ("http://127.0.0.1:9", now - timedelta(seconds=60))},
                secrets,
                now,
            )  # fmt: skip
        with transaction(factory) as session:
            lost = mark_lost_nodes(session, timeout_s=30.0, now=now)
            assert [n.name for n in lost] == ["b"]
        with transaction(factory) as session:
            job = session.get(Job, job_id)
            assert job is not None and job.state == JobState.QUEUED.value
            assert list(session.scalars(select(GpuSlot).where(GpuSlot.job_id == job_id))) == []
            event = session.scalars(
                select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.to_state == "QUEUED")
            ).one()
            assert event.reason == (
                "node b lost (no heartbeat for 30 s); its part there is lost: its GPUs elsewhere "
                "(2 on node a; its runner on node a) are freed too"
            )
            assert event.details == {
                "node": "b", "runner_lost": False, "runner_node": "a", "freed": {"a": [0, 1]},
            }  # fmt: skip
    finally:
        engine.dispose()
