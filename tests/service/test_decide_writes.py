"""The plan's write step gives each moved job exactly its commanded slots, with a fixed number of
slot statements however many jobs move (not one release and one assign per job)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from sqlalchemy import select

from scheduler_service.control_loop import ControlLoop
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, GpuSlot
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.api.test_read_queries import counted
from tests.service.test_budget_watchdog import _add_job, _config
from tests.support.rows import add_node


def test_moved_jobs_hold_exactly_their_commanded_slots(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()
    with transaction(factory) as session:
        for name in ("a", "b"):
            add_node(session, name, 8, state="ready", last_heartbeat_at=now + timedelta(hours=1))
    # Deadlines close enough that the plan must give GPUs now (no waiting for greener hours).
    for i in range(6):
        _add_job(
            factory, name=f"j{i}", total_samples=2 * 10**7, state=JobState.QUEUED.value,
            state_reason="submitted", deadline_at=now + timedelta(hours=3), created_at=now,
            updated_at=now,
        )  # fmt: skip
    loop = ControlLoop(_config(limit_kg=1000.0), factory, engine)

    async def forecast() -> Any:
        try:
            return await loop.carbon.get_forecast(loop.config.planner.horizon_s)
        finally:
            await loop.carbon.aclose()

    try:
        with counted(engine) as statements:
            loop._plan(asyncio.run(forecast()), utcnow())
        writes = [w for w in statements if w.lstrip().upper().startswith("UPDATE GPU_SLOTS")]
        with transaction(factory) as session:
            commands = list(session.scalars(select(Allocation).where(Allocation.gpus > 0)))
            held: dict[int, set[tuple[int, int]]] = {}
            for slot in session.scalars(select(GpuSlot).where(GpuSlot.job_id.is_not(None))):
                assert slot.job_id is not None
                held.setdefault(slot.job_id, set()).add((slot.node_id, slot.index))
        assert commands, "the plan moved no job"
        assert {c.job_id: {(c.node_id, i) for i in c.slot_indices} for c in commands} == held
        # One release and one assignment (executemany) for all moved jobs.
        assert len(writes) == 2, writes
    finally:
        engine.dispose()
