"""A tick's write step loads and locks only the jobs it writes (a command for a job whose
placement changes, a queued job deferred), and runs as many statements with many waiting jobs
whose placement does not change as with few."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from sqlalchemy import event, func, select

from scheduler_service.control_loop import ControlLoop
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, Job, JobEvent
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.api.test_read_queries import counted
from tests.service.test_budget_watchdog import _add_job, _config
from tests.support.rows import add_node


def test_the_write_step_loads_only_the_jobs_it_writes_and_its_statements_stay_flat(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()
    with transaction(factory) as session:
        add_node(session, "n1", 8, state="ready", last_heartbeat_at=now + timedelta(hours=1))
    loop = ControlLoop(_config(limit_kg=1000.0), factory, engine)

    async def forecast() -> Any:
        try:
            return await loop.carbon.get_forecast(loop.config.planner.horizon_s)
        finally:
            await loop.carbon.aclose()

    carbon = asyncio.run(forecast())
    write_plan = loop._write_plan
    phase: dict[str, Any] = {}

    def counted_write(*args: Any, **kwargs: Any) -> None:
        loaded: list[int] = []

        def on_load(job: Job, _context: Any) -> None:
            loaded.append(job.id)

        event.listen(Job, "load", on_load)
        try:
            with counted(engine) as statements:
                write_plan(*args, **kwargs)
        finally:
            event.remove(Job, "load", on_load)
        phase.update(statements=len(statements), loaded=set(loaded))

    loop._write_plan = counted_write  # type: ignore[method-assign]

    def queue(count: int, first: int) -> None:
        for i in range(count):
            _add_job(
                factory, name=f"q{first + i}", total_samples=10**9, state=JobState.QUEUED.value,
                state_reason="submitted", created_at=now, updated_at=now,
            )  # fmt: skip

    def tick() -> tuple[int, set[int], set[int], int]:
        """The write step's statements, the jobs it loaded, the jobs it wrote, jobs planned."""
        with transaction(factory) as session:
            before = {
                "commands": session.scalar(select(func.count()).select_from(Allocation)),
                "events": session.scalar(select(func.count()).select_from(JobEvent)),
            }
        planned, _ = loop._plan(carbon, utcnow())
        with transaction(factory) as session:
            new_commands = session.scalars(
                select(Allocation.job_id).order_by(Allocation.id).offset(before["commands"])
            )
            new_events = session.scalars(
                select(JobEvent.job_id).order_by(JobEvent.id).offset(before["events"])
            )
            written = set(new_commands) | set(new_events)
        return phase["statements"], phase["loaded"], written, planned

    try:
        queue(3, 0)
        tick()  # the first plan: commands for the jobs it runs, the others deferred
        steady_few = tick()
        queue(40, 100)
        tick()
        steady_many = tick()
        assert steady_many[3] == 43
        for _, loaded, written, _ in (steady_few, steady_many):
            # Only the jobs written were loaded (and locked), not every planned job.
            assert loaded <= written
        # 8 GPUs: at most 8 jobs change placement; the 43 others were neither loaded nor locked.
        assert len(steady_many[1]) <= 8
        assert steady_many[0] == steady_few[0]
    finally:
        engine.dispose()
