"""A command the agent refuses is rolled back: the job holds again the slots of its newest
acknowledged command (what the agent still runs), so the next tick sees where it really is."""

from __future__ import annotations

from sqlalchemy import select

from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, GpuSlot, Job
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.service import record_failure
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.repository import NodeRepository
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.support.rows import add_node


def test_a_refused_resize_gives_the_job_back_its_acknowledged_slots(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()
    with transaction(factory) as session:
        node_id = add_node(session, "n-refuse", 4, last_heartbeat_at=now).id
        jobs = [
            Job(
                owner="alice",
                name=name,
                workload="mlp",
                global_batch_size=16,
                total_samples=10**6,
                min_gpus=1,
                max_gpus=4,
                state=state.value,
                state_reason="",
                created_at=now,
                updated_at=now,
            )
            for name, state in (("resized", JobState.RESIZING), ("new", JobState.QUEUED))
        ]
        session.add_all(jobs)
        session.flush()
        resized, new = (j.id for j in jobs)
        # `resized` runs on slots 0-1 (acknowledged); the tick asked it to take all four, and
        # `new` to start on slot 3 (staged before the agent answered), slots given at once.
        session.add(
            Allocation(
                job_id=resized, generation=1, node_id=node_id, gpus=2, slot_indices=[0, 1],
                status="acked",
            )
        )  # fmt: skip
        grow = Allocation(
            job_id=resized, generation=2, node_id=node_id, gpus=4, slot_indices=[0, 1, 2, 3],
            status="pending",
        )  # fmt: skip
        start = Allocation(
            job_id=new, generation=1, node_id=node_id, gpus=1, slot_indices=[3], status="pending"
        )
        session.add_all([grow, start])
        session.flush()
        grow_id, start_id = grow.id, start.id
        NodeRepository(session).assign(node_id, [0, 1, 2, 3], resized)

    def holders() -> dict[int, int | None]:
        with transaction(factory) as session:
            slots = session.scalars(select(GpuSlot).where(GpuSlot.node_id == node_id))
            return {s.index: s.job_id for s in slots}

    try:
        assert holders() == {0: resized, 1: resized, 2: resized, 3: resized}
        with transaction(factory) as session:
            record_failure(session, grow_id, "409: slot 3 is held", rejected=True)
        # Back on its two acknowledged slots; the two it never got are free for the planner.
        assert holders() == {0: resized, 1: resized, 2: None, 3: None}
        with transaction(factory) as session:
            row = session.get(Job, resized)
            assert row is not None and row.state == JobState.RUNNING.value
            assert "resize refused by agent" in row.state_reason
        # A refused first start: the job runs nowhere, so it holds nothing.
        with transaction(factory) as session:
            NodeRepository(session).assign(node_id, [3], new)
        with transaction(factory) as session:
            record_failure(session, start_id, "422: bad layout", rejected=True)
        assert holders() == {0: resized, 1: resized, 2: None, 3: None}
        # A failure to reach the agent is no refusal: the command is retried, slots kept.
        with transaction(factory) as session:
            NodeRepository(session).assign(node_id, [2, 3], new)
            retry = Allocation(
                job_id=new,
                generation=2,
                node_id=node_id,
                gpus=2,
                slot_indices=[2, 3],
                status="pending",
            )
            session.add(retry)
            session.flush()
            retry_id = retry.id
        with transaction(factory) as session:
            record_failure(session, retry_id, "connection refused", rejected=False)
        assert holders() == {0: resized, 1: resized, 2: new, 3: new}
    finally:
        engine.dispose()


def test_a_refusal_overtaken_by_a_newer_command_changes_no_slot(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()
    with transaction(factory) as session:
        node_id = add_node(session, "n-overtaken", 2, last_heartbeat_at=now).id
        job = Job(
            owner="alice", name="j", workload="mlp", global_batch_size=16, total_samples=10**6,
            min_gpus=1, max_gpus=2, state=JobState.RUNNING.value, state_reason="",
            created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(job)
        session.flush()
        job_id = job.id
        commands = [
            Allocation(
                job_id=job_id,
                generation=g,
                node_id=node_id,
                gpus=n,
                slot_indices=ix,
                status=status,
            )
            for g, n, ix, status in (
                (1, 1, [0], "acked"),
                (2, 2, [0, 1], "superseded"),
                (3, 2, [0, 1], "pending"),
            )
        ]
        session.add_all(commands)
        session.flush()
        refused_id = commands[1].id
        NodeRepository(session).assign(node_id, [0, 1], job_id)
    try:
        with transaction(factory) as session:
            record_failure(session, refused_id, "409: stale generation", rejected=True)
        with transaction(factory) as session:
            held = session.scalars(select(GpuSlot.index).where(GpuSlot.job_id == job_id))
            assert sorted(held) == [0, 1]  # generation 3 decides, not the acknowledged 1
    finally:
        engine.dispose()
