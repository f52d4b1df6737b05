"""A tick with no node up reads and writes in a fixed number of statements, however many jobs
wait, and loads no waiting job as an ORM object: its snapshot reads plain rows, why it waits is
compared on plain rows, and deadlines are checked only for jobs past theirs."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from sqlalchemy import event, select

from scheduler_service.control_loop import ControlLoop
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Job, JobEvent
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.api.test_read_queries import counted
from tests.service.test_budget_watchdog import _add_job, _config


def test_a_tick_without_nodes_costs_the_same_statements_for_few_and_many_queued_jobs(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()
    loop = ControlLoop(_config(limit_kg=1000.0), factory, engine)

    def queue(count: int, first: int) -> list[int]:
        return [
            _add_job(
                factory,
                name=f"q{first + i}",
                total_samples=10**9,
                state=JobState.QUEUED.value,
                state_reason="submitted",
                created_at=now,
                updated_at=now,
            )
            for i in range(count)
        ]

    def tick() -> tuple[int, int]:
        """Statements run and Job rows loaded (as ORM objects) by one tick."""

        async def run() -> None:
            try:
                await loop.tick()
            finally:
                await loop.agents.aclose()

        loaded: list[int] = []

        def on_load(job: Job, _context: Any) -> None:
            loaded.append(job.id)

        event.listen(Job, "load", on_load)
        try:
            with counted(engine) as statements:
                asyncio.run(run())
        finally:
            event.remove(Job, "load", on_load)
        return len(statements), len(loaded)

    # Deadlines passed: one job is stopped, one runs on past it (noted once, not every tick).
    missed = _add_job(
        factory, name="late", total_samples=10**9, state=JobState.QUEUED.value,
        state_reason="submitted", deadline_at=now - timedelta(minutes=1), created_at=now,
        updated_at=now,
    )  # fmt: skip
    running_on = _add_job(
        factory, name="on", total_samples=10**9, state=JobState.QUEUED.value,
        state_reason="submitted", deadline_at=now - timedelta(minutes=1), run_past_deadline=True,
        created_at=now, updated_at=now,
    )  # fmt: skip
    try:
        few = queue(3, 0)
        tick()  # the first tick writes every new job's reason and the missed deadlines
        steady_few = tick()
        many = queue(40, 100)
        tick()
        steady_many = tick()
        # As many statements; no queued job loaded as an ORM object (the snapshot reads plain
        # rows of the columns it plans from), only the one running on past its deadline (the
        # deadline check). Before, each waiting job was loaded once (5 and 45 here), and before
        # that three times: for the deadline check, the snapshot, and to compare its reason.
        assert steady_many[0] == steady_few[0]
        assert (steady_few[1], steady_many[1]) == (1, 1)
        with transaction(factory) as session:
            reasons = {j: r for j, r in session.execute(select(Job.id, Job.state_reason))}
            assert all("GPUs" in reasons[job_id] for job_id in [*few, *many, running_on])
            job = session.get(Job, missed)
            assert job is not None and job.state == JobState.DEADLINE_MISSED.value
            notes = session.scalars(
                select(JobEvent.id).where(
                    JobEvent.job_id == running_on, JobEvent.kind == "deadline_missed"
                )
            ).all()
            assert len(notes) == 1
    finally:
        engine.dispose()
