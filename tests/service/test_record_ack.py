"""What an agent's answer to a command records on the job: a start, a hot switch, or nothing
when the command found the job already running on exactly its slots."""

from __future__ import annotations

from sqlalchemy import select

from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, Job, JobEvent
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.service import record_ack
from scheduler_service.jobs.states import JobState
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from worker_agent.protocol import AllocationAck


def test_a_command_that_changes_nothing_records_no_new_start(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()
    with transaction(factory) as session:
        job = Job(
            owner="alice", name="j", workload="mlp", global_batch_size=16,
            total_samples=10**6, min_gpus=1, max_gpus=2, state=JobState.QUEUED.value,
            state_reason="", created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(job)
        session.flush()
        job_id = job.id
        commands = [
            Allocation(job_id=job_id, generation=g, gpus=2, slot_indices=[0, 1], status="pending")
            for g in (1, 2)
        ]
        session.add_all(commands)
        session.flush()
        first, second = (c.id for c in commands)

    def ack(generation: int, resumed_from: str | None) -> AllocationAck:
        return AllocationAck(
            job_id=job_id, generation=generation, gpus=2, layout="dp2-tp1-pp1", step=7,
            worker_pids=[11, 12], resumed_from=resumed_from,
        )  # fmt: skip

    def kinds() -> list[str]:
        with transaction(factory) as session:
            return list(
                session.scalars(
                    select(JobEvent.kind).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
                )
            )

    try:
        with transaction(factory) as session:
            record_ack(session, first, ack(1, "start"))
        assert kinds() == ["allocation", "state"]
        # Generation 2 on the same slots: the agent answers that no run started.
        with transaction(factory) as session:
            record_ack(session, second, ack(2, None))
        assert kinds() == ["allocation", "state"]
        with transaction(factory) as session:
            row = session.get(Job, job_id)
            assert row is not None
            assert (row.state, row.current_gpus, row.step) == (JobState.RUNNING.value, 2, 7)
            assert session.get(Allocation, second).status == "acked"  # type: ignore[union-attr]
    finally:
        engine.dispose()
