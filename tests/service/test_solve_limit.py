"""The tick's solve time limit follows the slot unless the operator sets one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from scheduler_service.allocation.problem import AllocationPlan
from scheduler_service.control_loop import ControlLoop
from scheduler_service.db import migrate
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Job
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from scheduler_service.settings import GreenflowConfig, PlannerConfig
from tests.support.rows import add_node


@pytest.mark.parametrize(
    ("slot_s", "limit_s"), [(30, 2.0), (60, 2.0), (300, 5.0), (900, 15.0), (7_200, 60.0)]
)
def test_the_default_limit_is_a_sixtieth_of_the_slot_within_2_to_60_s(
    slot_s: int, limit_s: float
) -> None:
    assert PlannerConfig(slot_s=slot_s).solve_limit_s() == limit_s


def test_a_configured_limit_wins_over_the_slots() -> None:
    assert PlannerConfig(slot_s=900, solver_time_limit_s=0.5).solve_limit_s() == 0.5


@pytest.mark.parametrize(
    ("planner", "limit_s"),
    [({"slot_s": 900}, 15.0), ({"slot_s": 900, "solver_time_limit_s": 3}, 3.0)],
)
def test_a_tick_solves_under_the_planners_limit(
    tmp_path: Path, planner: dict[str, Any], limit_s: float
) -> None:
    url = f"sqlite:///{tmp_path / 'loop.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    factory = make_session_factory(engine)
    with transaction(factory) as session:
        add_node(session, "n1", 8, last_heartbeat_at=utcnow())
        session.add(
            Job(
                name="limit", owner="alice", workload="resnet50", global_batch_size=256,
                total_samples=1_000_000, min_gpus=1,
                max_gpus=8, state=JobState.QUEUED,
            )
        )  # fmt: skip
    config = GreenflowConfig.model_validate(
        {"carbon": {"provider": "synthetic"}, "planner": {"horizon_s": 3_600, **planner}}
    )
    loop = ControlLoop(config, factory, engine)
    limits_s: list[float] = []
    policy = loop.policy

    def recording_policy(*args: Any, time_limit_s: float, **kwargs: Any) -> AllocationPlan:
        limits_s.append(time_limit_s)
        return policy(*args, time_limit_s=time_limit_s, **kwargs)

    loop.policy = recording_policy
    try:

        async def tick() -> int:
            try:
                return (await loop.tick()).jobs_planned
            finally:
                await loop.agents.aclose()

        jobs_planned = asyncio.run(tick())
        assert limits_s == [limit_s]
        assert jobs_planned == 1
    finally:
        asyncio.run(loop.carbon.aclose())
        engine.dispose()
