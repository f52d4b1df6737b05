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


class _Ticks:
    """A control loop on `database_url` (one node of `gpus` GPUs) whose write step is counted:
    its statements and the jobs it loaded as ORM objects."""

    def __init__(self, url: str, gpus: int) -> None:
        self.engine = make_engine(url)
        self.factory = make_session_factory(self.engine)
        self.now = utcnow()
        with transaction(self.factory) as session:
            add_node(
                session, "n1", gpus, state="ready", last_heartbeat_at=self.now + timedelta(hours=1)
            )
        self.loop = ControlLoop(_config(limit_kg=1000.0), self.factory, self.engine)
        loop = self.loop

        async def forecast() -> Any:
            try:
                return await loop.carbon.get_forecast(loop.config.planner.horizon_s)
            finally:
                await loop.carbon.aclose()

        self.carbon = asyncio.run(forecast())
        write_plan = loop._write_plan
        self.phase: dict[str, Any] = {}

        def counted_write(*args: Any, **kwargs: Any) -> None:
            loaded: list[int] = []

            def on_load(job: Job, _context: Any) -> None:
                loaded.append(job.id)

            sent: list[int] = []

            def on_execute(
                _conn: Any, _cursor: Any, _sql: str, params: Any, _ctx: Any, many: bool
            ) -> None:
                # An executemany sends one statement per parameter set.
                sent.append(len(params) if many else 1)

            event.listen(Job, "load", on_load)
            event.listen(self.engine, "before_cursor_execute", on_execute)
            try:
                with counted(self.engine) as statements:
                    write_plan(*args, **kwargs)
            finally:
                event.remove(Job, "load", on_load)
                event.remove(self.engine, "before_cursor_execute", on_execute)
            self.phase.update(statements=len(statements), loaded=set(loaded), sent=sum(sent))

        loop._write_plan = counted_write  # type: ignore[method-assign]

    def queue(self, count: int, first: int, priority: int = 1) -> list[int]:
        """`count` queued jobs; their ids."""
        fields = {
            "total_samples": 10**9,
            "state": JobState.QUEUED.value,
            "state_reason": "submitted",
            "created_at": self.now,
            "updated_at": self.now,
            "priority": priority,
        }
        return [_add_job(self.factory, name=f"q{first + i}", **fields) for i in range(count)]

    def tick(self) -> tuple[int, set[int], set[int], int]:
        """The write step's statements, the jobs it loaded, the jobs it wrote, jobs planned."""
        with transaction(self.factory) as session:
            before = {
                "commands": session.scalar(select(func.count()).select_from(Allocation)),
                "events": session.scalar(select(func.count()).select_from(JobEvent)),
            }
        planned, _ = self.loop._plan(self.carbon, utcnow())
        with transaction(self.factory) as session:
            new_commands = session.scalars(
                select(Allocation.job_id).order_by(Allocation.id).offset(before["commands"])
            )
            new_events = session.scalars(
                select(JobEvent.job_id).order_by(JobEvent.id).offset(before["events"])
            )
            written = set(new_commands) | set(new_events)
        return self.phase["statements"], self.phase["loaded"], written, planned

    def deferred(self, job_ids: list[int]) -> set[int]:
        """Which of these jobs are DEFERRED, with the event of their move from QUEUED."""
        with transaction(self.factory) as session:
            return set(
                session.scalars(
                    select(Job.id)
                    .join(JobEvent, JobEvent.job_id == Job.id)
                    .where(
                        Job.id.in_(job_ids),
                        Job.state == JobState.DEFERRED.value,
                        JobEvent.from_state == JobState.QUEUED.value,
                        JobEvent.to_state == JobState.DEFERRED.value,
                    )
                )
            )


def test_the_write_step_loads_only_the_jobs_it_writes_and_its_statements_stay_flat(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    ticks = _Ticks(database_url, 8)
    queue, tick, engine = ticks.queue, ticks.tick, ticks.engine
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


def test_queued_jobs_are_deferred_in_one_update_however_many_and_none_is_loaded(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # One GPU, held by the first job (the highest priority): every job queued after it waits.
    ticks = _Ticks(database_url, 1)
    try:
        ticks.queue(1, 0, priority=100)
        ticks.tick()
        few = ticks.queue(3, 10)
        statements_few, loaded_few, _, _ = ticks.tick()
        many = ticks.queue(30, 100)
        statements_many, loaded_many, _, planned = ticks.tick()
        assert planned == 34
        assert ticks.deferred(few) == set(few) and ticks.deferred(many) == set(many)
        # Not loaded as ORM objects, and 30 deferred in as many statements as 3.
        assert not loaded_few & set(few) and not loaded_many & set(many)
        assert statements_many == statements_few
    finally:
        ticks.engine.dispose()


def test_on_postgresql_deferring_and_storing_the_plan_send_as_many_statements_for_30_jobs_as_3(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # One GPU, held by the first job: every job queued after it is deferred (its row updated,
    # an event added) and has a row in the stored plan. On PostgreSQL each of those writes binds
    # one array per column (`db.bulk`); SQLite sends an executemany, a statement per row.
    ticks = _Ticks(database_url, 1)
    try:
        ticks.queue(1, 0, priority=100)
        ticks.tick()
        few = ticks.queue(3, 10)
        ticks.tick()
        sent_few = ticks.phase["sent"]
        many = ticks.queue(30, 100)
        _, _, _, planned = ticks.tick()
        sent_many = ticks.phase["sent"]
        assert planned == 34
        assert ticks.deferred(few) == set(few) and ticks.deferred(many) == set(many)
        if ticks.engine.dialect.name == "postgresql":
            assert sent_many == sent_few
        else:
            # 30 more deferred jobs: 30 more UPDATEs, events and plan rows each.
            assert sent_many >= sent_few + 3 * 27
    finally:
        ticks.engine.dispose()
