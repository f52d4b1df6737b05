"""A spanning job whose runner's node went on alone after losing the job's other node (from the
survivors' replicas, `RunningJob.lost_nodes`): the scheduler frees the job's slots on the other
node, records it once, and the lost node's timeout then re-queues nothing (issue 20)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from scheduler_service.auth.service import Principal
from scheduler_service.auth.tokens import Role
from scheduler_service.db.models import Allocation, GpuSlot, Job, JobEvent, Node
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.nodes.service import heartbeat, mark_lost_nodes
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.support.rows import add_node
from worker_agent.protocol import Heartbeat, RunningJob


def test_the_runner_node_going_on_alone_frees_the_lost_nodes_slots_once(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = datetime.now(UTC)
    with transaction(factory) as session:
        nodes = {
            name: add_node(
                session,
                name,
                2,
                last_heartbeat_at=now,
                secret_key_id="k",
                agent_secret_nonce="nonce",
            ).id
            for name in ("a", "b")
        }
        job = Job(
            owner="alice", name="wide", workload="resnet50", global_batch_size=256,
            total_samples=10**9, min_gpus=1, max_gpus=4, state=JobState.RUNNING.value,
            state_reason="", created_at=now, updated_at=now, current_gpus=4,
            current_layout="dp2-tp2-pp1",
        )  # fmt: skip
        session.add(job)
        session.flush()
        job_id = job.id
        session.add(
            Allocation(
                job_id=job_id, generation=1, node_id=nodes["a"], gpus=4, slot_indices=[0, 1],
                parts=[[nodes["b"], [0, 1]]], status="acked",
            )
        )  # fmt: skip
        NodeRepository(session).assign_parts([(nodes["a"], [0, 1]), (nodes["b"], [0, 1])], job_id)
    alone = RunningJob(
        job_id=job_id, generation=1, gpus=2, slot_indices=[0, 1], layout="dp1-tp2-pp1",
        step=120, samples_done=120 * 256, worker_pids=[11, 12], lost_nodes=["b"],
    )  # fmt: skip
    principal = Principal(name="a", role=Role.AGENT, token_id="t")
    replans: list[str] = []

    def beat() -> None:
        with transaction(factory) as session:
            ack = heartbeat(
                session, principal, "a", Heartbeat(jobs=[alone]), key_id="k",
                replan=lambda: replans.append("a"),
            )  # fmt: skip
            assert ack.stop_job_ids == []

    def losses() -> list[JobEvent]:
        with transaction(factory) as session:
            return list(
                session.scalars(
                    select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "node_lost")
                )
            )

    try:
        beat()
        beat()  # told again until the next command: recorded once
        # The first report changed where the job runs: the loop is asked to plan again (once).
        assert replans == ["a"]
        with transaction(factory) as session:
            held = session.scalars(select(GpuSlot).where(GpuSlot.job_id == job_id))
            assert sorted((s.node_id, s.index) for s in held) == [(nodes["a"], 0), (nodes["a"], 1)]
            row = session.get(Job, job_id)
            assert row is not None
            assert (row.state, row.current_gpus, row.current_layout) == (
                JobState.RUNNING.value, 2, "dp1-tp2-pp1",
            )  # fmt: skip
        (event,) = losses()
        assert "node(s) b lost" in event.reason and "from its replicas at step 120" in event.reason
        assert event.details is not None and event.details["lost_nodes"] == ["b"]
        # Node b's heartbeats then time out: the job holds nothing there, so it is not re-queued.
        with transaction(factory) as session:
            b = session.get(Node, nodes["b"])
            assert b is not None
            b.last_heartbeat_at = now - timedelta(minutes=5)
        with transaction(factory) as session:
            lost = mark_lost_nodes(session, timeout_s=30, now=now + timedelta(seconds=1))
            assert [n.name for n in lost] == ["b"]
        with transaction(factory) as session:
            row = session.get(Job, job_id)
            assert row is not None and row.state == JobState.RUNNING.value
    finally:
        engine.dispose()
