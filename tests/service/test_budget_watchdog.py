"""The budget watchdog: measured spend between ticks wakes the planner when a hard budget is at risk."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from scheduler_service.budget.periods import period_containing
from scheduler_service.budget.watchdog import SpendExpectation, replan_reason
from scheduler_service.control_loop import ControlLoop
from scheduler_service.db import migrate
from scheduler_service.db.models import Job, LedgerEntry, TelemetrySample
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from scheduler_service.ledger import PeriodStatus
from scheduler_service.settings import GreenflowConfig
from tests.api.conftest import database_url, postgres_server  # noqa: F401 (fixtures)

DAY = period_containing(datetime(2026, 3, 2, 12, tzinfo=UTC), "day")
PLAN_AT = DAY.start_at + timedelta(hours=10)


def _status(spent_kg: float, limit_kg: float = 1.0) -> PeriodStatus:
    return PeriodStatus(DAY.start_at, DAY.end_at, limit_kg, spent_kg, energy_kwh=0.0)


def _expectation(spent_at_plan_kg: float, kg_per_slot: float = 0.01) -> SpendExpectation:
    # Hourly slots from 10:00, each planned to spend kg_per_slot.
    return SpendExpectation(
        period_start_at=DAY.start_at,
        period_end_at=DAY.end_at,
        spent_at_plan_kg=spent_at_plan_kg,
        plan_start_at=PLAN_AT,
        slot_s=3600.0,
        planned_kg_per_slot=(kg_per_slot,) * 24,
    )


def test_planned_spend_is_read_by_time_share_and_clipped_to_the_period() -> None:
    expectation = _expectation(0.0, kg_per_slot=0.01)
    half_hour = PLAN_AT + timedelta(minutes=30)
    assert expectation.planned_kg_between(PLAN_AT, half_hour) == pytest.approx(0.005)
    # 10:00 to the day's end is 14 slots; the plan's slots after midnight are the next period's.
    assert expectation.planned_kg_between(PLAN_AT, PLAN_AT + timedelta(days=2)) == pytest.approx(
        0.14
    )
    assert expectation.planned_kg_between(PLAN_AT - timedelta(hours=5), PLAN_AT) == 0.0


def test_a_spent_budget_wakes_the_planner_once() -> None:
    now = PLAN_AT + timedelta(minutes=20)
    reason = replan_reason(_status(1.02), _expectation(0.9), now)
    assert reason is not None and "is spent" in reason and "1.02 of 1 kg" in reason
    # The plan in force was made after the budget ran out: it already runs nothing.
    assert replan_reason(_status(1.05), _expectation(1.01), now) is None
    # No plan yet, or a plan from the day before: a spent budget still wakes it.
    assert replan_reason(_status(1.02), None, now) is not None


def test_spending_faster_than_planned_wakes_only_when_the_budget_is_at_risk() -> None:
    now = PLAN_AT + timedelta(hours=2)  # the plan expected 0.02 kg by now
    # As planned (or within the tolerance): no reason.
    assert replan_reason(_status(0.52), _expectation(0.5), now) is None
    assert replan_reason(_status(0.521), _expectation(0.5), now) is None
    # Twice the plan's rate: 0.54 spent + 2 x 0.12 planned for the other 12 h = 0.78 <= 1 kg.
    assert replan_reason(_status(0.54), _expectation(0.5), now) is None
    # Twice the plan's rate with less room: 0.84 + 0.24 > 1 kg.
    reason = replan_reason(_status(0.84), _expectation(0.8), now)
    assert reason is not None and "2.00x what the plan expected" in reason
    # The plan from another period says nothing about this one's rate.
    other_day = SpendExpectation(
        period_start_at=DAY.start_at - timedelta(days=1),
        period_end_at=DAY.start_at,
        spent_at_plan_kg=0.0,
        plan_start_at=PLAN_AT - timedelta(days=1),
        slot_s=3600.0,
        planned_kg_per_slot=(0.001,) * 48,
    )
    assert replan_reason(_status(0.9), other_day, now) is None


def _config(limit_kg: float) -> GreenflowConfig:
    return GreenflowConfig.model_validate(
        {
            "budget": {"period": "day", "limit_kg_co2e": limit_kg, "enforcement": "hard"},
            "carbon": {"provider": "synthetic", "conservative_intensity_g_per_kwh": 500},
            "planner": {"slot_s": 300},
        }
    )


def test_the_loop_charges_new_telemetry_between_ticks_and_wakes_the_tick(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = datetime.now(UTC)
    with transaction(factory) as session:
        job = Job(
            owner="alice",
            name="big",
            workload="resnet50",
            global_batch_size=256,
            min_gpus=1,
            max_gpus=8,
            state=JobState.RUNNING.value,
            state_reason="running",
            created_at=now - timedelta(minutes=5),
            updated_at=now - timedelta(minutes=5),
        )
        session.add(job)
        session.flush()
        # 8 GPUs at 3 kW for the last minute: 0.05 kWh, far over a 1 g budget at any intensity.
        for i in range(12):
            session.add(
                TelemetrySample(
                    sample_id=f"w-{i}",
                    job_id=job.id,
                    node_id=None,
                    at=now - timedelta(seconds=55 - 5 * i),
                    interval_s=5.0,
                    step=i,
                    samples_done=1000 * i,
                    samples_per_s=200.0,
                    loss=None,
                    gpus=8,
                    layout="dp8",
                    power_w=3000.0,
                    energy_kwh=3000.0 * 5 / 3.6e6,
                    power_source="estimated",
                )
            )
    loop = ControlLoop(_config(limit_kg=0.001), factory, engine)

    async def sample_twice() -> tuple[str | None, bool, str | None]:
        loop._loop = asyncio.get_running_loop()
        first = await loop.sample_carbon_once(1.0)
        await asyncio.sleep(0)  # let the thread-safe wake run
        woken = loop.wake_event.is_set()
        loop.wake_event.clear()
        # Nothing new to charge: the watchdog stays quiet.
        second = await loop.sample_carbon_once(1.0)
        return first, woken, second

    try:
        first, woken, second = asyncio.run(sample_twice())
        assert first is not None and "is spent" in first
        assert woken and loop.budget_wakes == 1
        assert second is None and not loop.wake_event.is_set()
        with transaction(factory) as session:
            charged = session.scalar(select(func.count(LedgerEntry.id)))
            spent = session.scalar(select(func.sum(LedgerEntry.emissions_kg)))
        # Every sample charged once (none twice), and the spend is what made it wake.
        assert charged is not None and charged >= 12
        assert spent is not None and spent > 0.001
    finally:
        asyncio.run(loop.carbon.aclose())
        engine.dispose()


def test_a_wake_during_a_tick_starts_the_next_tick_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'loop.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    loop = ControlLoop(_config(limit_kg=1.0), make_session_factory(engine), engine)
    ticks: list[float] = []

    async def tick() -> None:
        ticks.append(asyncio.get_running_loop().time())
        if len(ticks) == 1:
            loop.wake()  # e.g. a job submitted while this tick plans
            await asyncio.sleep(0.05)
        else:
            loop._stopping = True
            loop.wake_event.set()  # as stop() does

    async def run() -> None:
        loop._loop = asyncio.get_running_loop()
        loop.leader.try_acquire = lambda: True  # type: ignore[method-assign]
        loop.tick = tick  # type: ignore[method-assign,assignment]
        # The slot is 300 s: only the wake can bring the second tick within the timeout.
        await asyncio.wait_for(loop._tick_forever(), timeout=20)

    try:
        asyncio.run(run())
        assert len(ticks) == 2
    finally:
        asyncio.run(loop.carbon.aclose())
        engine.dispose()
