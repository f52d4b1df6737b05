"""The budget watchdog: measured spend between ticks wakes the planner when a hard budget is at risk.

Also how the loop ticks when woken, and when a tick fails (retried after a backoff, watchdog re-armed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from energy_model.carbon.forecast import CarbonForecast
from energy_model.carbon.resilient import ResilientCarbonSource
from scheduler_service.allocation.policies import get_policy
from scheduler_service.allocation.problem import AllocationProblem, BudgetPeriod, JobSpec
from scheduler_service.budget.ledger import current_period
from scheduler_service.budget.periods import PeriodStatus, period_containing
from scheduler_service.budget.watchdog import SpendExpectation, replan_reason, watch_lead_s
from scheduler_service.carbon.service import make_carbon_source
from scheduler_service.control_loop import ControlLoop
from scheduler_service.db import migrate
from scheduler_service.db.models import CarbonForecastRecord, Job, LedgerEntry, TelemetrySample
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
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


def test_the_lead_runs_to_a_stop_decided_at_the_next_check() -> None:
    # The next check, the telemetry it has not heard of yet, the tick that stops the jobs.
    assert watch_lead_s(60.0, 5.0, 2.0) == pytest.approx(67.0)


def test_a_budget_about_to_run_out_wakes_the_planner_before_it_is_spent() -> None:
    now = PLAN_AT + timedelta(minutes=20)
    # Made at 0.9 kg, planning 0.15 kg an hour: the 0.05 kg spent since is just what it expected.
    plan = _expectation(0.9, kg_per_slot=0.15)
    # 1 g/s for 60 s reaches 0.95 + 0.06 >= 1 kg: wake now, while 0.05 kg are still left.
    reason = replan_reason(_status(0.95), plan, now, rate_kg_per_s=0.001, lead_s=60.0)
    assert reason is not None and "would be spent within 60 s" in reason
    assert "0.95 of 1 kg" in reason
    # At half that rate the budget outlasts the lead: the next check is soon enough.
    assert replan_reason(_status(0.95), plan, now, rate_kg_per_s=0.0005, lead_s=60.0) is None
    # Without a lead the rule is off: only a spent budget or a runaway spend wakes the tick.
    assert replan_reason(_status(0.95), plan, now, rate_kg_per_s=1.0, lead_s=0.0) is None
    # No plan for this period yet: the measured rate alone tells.
    assert replan_reason(_status(0.95), None, now, rate_kg_per_s=0.001, lead_s=60.0) is not None


def test_the_plans_rate_counts_where_it_is_higher_than_the_measured_one() -> None:
    now = PLAN_AT + timedelta(minutes=20)
    # A plan that runs the jobs at 3.6 kg an hour (1 g/s); the telemetry shows less so far.
    plan = _expectation(0.9, kg_per_slot=3.6)
    reason = replan_reason(_status(0.95), plan, now, rate_kg_per_s=0.0001, lead_s=60.0)
    assert reason is not None and "at 0.001 kg/s" in reason


def test_a_budget_about_to_run_out_wakes_the_planner_once_per_plan() -> None:
    now = PLAN_AT + timedelta(minutes=20)
    # The plan in force was made with 0.04 kg left, less than 60 s at 1 g/s: it is the plan
    # the early wake asked for, and it already saw the budget almost gone.
    plan = _expectation(0.96, kg_per_slot=0.03)  # 0.01 kg in 20 min, as spent
    assert replan_reason(_status(0.97), plan, now, rate_kg_per_s=0.001, lead_s=60.0) is None
    # When the spend passes the limit all the same, that plan is told once more.
    reason = replan_reason(_status(1.001), plan, now, rate_kg_per_s=0.001, lead_s=60.0)
    assert reason is not None and "is spent" in reason


def test_an_expectation_from_another_period_does_not_silence_the_early_wake() -> None:
    now = PLAN_AT + timedelta(minutes=20)
    # Made yesterday with 0.99 kg of yesterday's budget spent: it says nothing about today's.
    yesterday = SpendExpectation(
        period_start_at=DAY.start_at - timedelta(days=1),
        period_end_at=DAY.start_at,
        spent_at_plan_kg=0.99,
        plan_start_at=PLAN_AT - timedelta(days=1),
        slot_s=3600.0,
        planned_kg_per_slot=(3.6,) * 48,
    )
    reason = replan_reason(_status(0.95), yesterday, now, rate_kg_per_s=0.001, lead_s=60.0)
    assert reason is not None and "would be spent within" in reason
    # Nor does its planned rate count for today: 3.6 kg an hour would reach 1 kg in 60 s.
    assert replan_reason(_status(0.95), yesterday, now, rate_kg_per_s=0.0, lead_s=60.0) is None


@pytest.mark.parametrize(("left_kg", "slot0_gpus"), [(0.01, {0}), (0.0268, {1, 2, 4})])
def test_the_plan_an_early_wake_gets_stops_or_shrinks_the_jobs_within_what_is_left(
    left_kg: float, slot0_gpus: set[int]
) -> None:
    # A job on 8 GPUs (3 kW; 1 GPU: 400 W) at 400 g/kWh and PUE 1.2: 0.4 g/s on 8 GPUs, and a
    # whole 300 s slot on 1 GPU costs 16 g. 10 g left: not even that slot fits, so it stops;
    # 26.8 g (the 67 s lead at 0.4 g/s): it shrinks to what one slot can pay for.
    job = JobSpec(
        "1", (1, 2, 4, 8), (100.0, 190.0, 360.0, 700.0), (400.0, 780.0, 1550.0, 3000.0), 1e9,
        current_gpus=8,
    )  # fmt: skip
    problem = AllocationProblem(
        start_at=PLAN_AT,
        slot_s=300.0,
        capacity_gpus=(8,) * 24,
        intensity_g_per_kwh=(400.0,) * 24,
        jobs=(job,),
        pue=1.2,
        budget_periods=(BudgetPeriod(-36_000.0, 50_400.0, left_kg),),
    )
    plan = get_policy("greenflow")(problem, previous=None, time_limit_s=2.0, seed=0)
    assert plan.gpus["1"][0] in slot0_gpus
    # The hard budget holds in the plan: nothing beyond what is left, whole slots only.
    assert sum(plan.emissions_kg_per_slot) <= left_kg * (1 + 1e-6)


def _config(limit_kg: float, tick_retry_initial_s: float = 5.0) -> GreenflowConfig:
    return GreenflowConfig.model_validate(
        {
            "budget": {"period": "day", "limit_kg_co2e": limit_kg, "enforcement": "hard"},
            "carbon": {"provider": "synthetic", "conservative_intensity_g_per_kwh": 500},
            # The watchdog looks 60 + 5 + 2 = 67 s ahead (check, telemetry report, tick).
            "planner": {
                "slot_s": 300,
                "budget_check_interval_s": 60,
                "tick_latency_floor_s": 2,
                "tick_retry_initial_s": tick_retry_initial_s,
            },
            "cluster": {"agent_telemetry_interval_s": 5},
        }
    )


def _add_job(factory: sessionmaker[Session], **fields: Any) -> int:
    """A resnet50 job of alice's (1-8 GPUs) with `fields` set, stored; its id."""
    with transaction(factory) as session:
        job = Job(
            owner="alice", workload="resnet50", global_batch_size=256, min_gpus=1, max_gpus=8,
            **fields,
        )  # fmt: skip
        session.add(job)
        session.flush()
        return job.id


def _running_job(factory: sessionmaker[Session], now: datetime) -> int:
    return _add_job(
        factory,
        name="big",
        state=JobState.RUNNING.value,
        state_reason="running",
        created_at=now - timedelta(minutes=5),
        updated_at=now - timedelta(minutes=5),
    )


def _report(factory: sessionmaker[Session], job_id: int, ends: list[datetime]) -> None:
    """Telemetry as an agent sends it: 8 GPUs drawing 3 kW, one sample per 5 s ending at `ends`."""
    with transaction(factory) as session:
        for end_at in ends:
            session.add(
                TelemetrySample(
                    sample_id=f"w-{job_id}-{end_at.timestamp()}",
                    job_id=job_id,
                    node_id=None,
                    at=end_at,
                    interval_s=5.0,
                    step=0,
                    samples_done=0,
                    samples_per_s=200.0,
                    loss=None,
                    gpus=8,
                    layout="dp8",
                    power_w=3000.0,
                    energy_kwh=3000.0 * 5 / 3.6e6,
                    power_source="estimated",
                )
            )


def test_the_loop_charges_new_telemetry_between_ticks_and_wakes_the_tick(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = datetime.now(UTC)
    # 8 GPUs at 3 kW for the last minute: 0.05 kWh, far over a 1 g budget at any intensity.
    job_id = _running_job(factory, now)
    _report(factory, job_id, [now - timedelta(seconds=55 - 5 * i) for i in range(12)])
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


def test_the_loop_wakes_the_tick_before_the_budget_is_spent(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = datetime.now(UTC)
    job_id = _running_job(factory, now)
    # Each 5 s sample: 4.17 Wh x PUE 1.2 at the conservative 500 g/kWh (no intensity known
    # before it) = 2.5 g, so 0.5 g/s, 33.5 g over the watchdog's 67 s lead. Budget: 50 g.
    ends = [now - timedelta(seconds=200 - 5 * i) for i in range(21)]
    loop = ControlLoop(_config(limit_kg=0.05), factory, engine)
    assert loop.watch_lead_s() == pytest.approx(67.0)

    def spent_kg() -> float:
        with transaction(factory) as session:
            return current_period(session, loop.config).spent_kg

    def replan_at(spent: float) -> None:
        # What a tick does: plan (here: nothing) knowing the spend so far.
        with transaction(factory) as session:
            period = current_period(session, loop.config)
        assert period.spent_kg == pytest.approx(spent)
        loop._spend_expectation = SpendExpectation.of_nothing(datetime.now(UTC), 300.0, period)

    async def check(new_ends: list[datetime]) -> tuple[str | None, bool]:
        _report(factory, job_id, new_ends)
        loop._loop = asyncio.get_running_loop()
        reason = await loop.sample_carbon_once(60.0)
        await asyncio.sleep(0)  # let the thread-safe wake run
        woken = loop.wake_event.is_set()
        loop.wake_event.clear()
        return reason, woken

    try:
        replan_at(0.0)
        # 10 g spent, 43.5 g with the lead: the next check comes soon enough.
        assert asyncio.run(check(ends[:4])) == (None, False)
        assert spent_kg() == pytest.approx(0.01)
        # 20 g spent, 53.5 g with the lead: wake now, 30 g before the budget is spent.
        reason, woken = asyncio.run(check(ends[4:8]))
        assert reason is not None and "would be spent within 67 s" in reason
        assert woken and loop.budget_wakes == 1
        assert spent_kg() == pytest.approx(0.02) and spent_kg() < 0.05
        # The tick has not re-planned yet: one wake for this plan is enough.
        assert asyncio.run(check(ends[8:9])) == (None, False)
        # The tick re-plans with 27.5 g left, less than the lead's 33.5 g: it saw the end coming.
        replan_at(0.0225)
        assert asyncio.run(check(ends[9:10])) == (None, False)
        # The jobs run on past the limit all the same: the plan that thought 25 g left is told.
        reason, woken = asyncio.run(check(ends[10:]))
        assert reason is not None and "is spent" in reason
        assert woken and loop.budget_wakes == 2
        assert spent_kg() == pytest.approx(0.0525)
    finally:
        asyncio.run(loop.carbon.aclose())
        engine.dispose()


class _FailingCarbon(ResilientCarbonSource):
    """The configured carbon source, except that its next `failures_left` forecasts raise."""

    def __init__(self, config: GreenflowConfig, failures: int) -> None:
        real = make_carbon_source(config.carbon)
        super().__init__(
            real.provider, real.conservative_intensity_g_per_kwh, real.max_forecast_age_s
        )
        self.failures_left = failures
        self.calls_at_s: list[float] = []

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        """Raise while failures are left, else the real forecast."""
        self.calls_at_s.append(time.monotonic())
        if self.failures_left > 0:
            self.failures_left -= 1
            # An error the failure policy has no type for (not a CarbonProviderError): it reaches
            # the tick instead of falling back to the cached or conservative forecast.
            raise ValueError("malformed provider answer")
        return await super().get_forecast(horizon_s)


def _tick_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What the loop logged for each failed tick, in order."""
    return [
        record
        for record in caplog.records
        if record.name == "greenflow.loop"
        and str(record.msg).startswith("control-loop tick failed")
    ]


def _retry_delays_s(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The backoff the loop logged for each failed tick, in order."""
    delays_s: list[float] = []
    for record in _tick_failures(caplog):
        assert isinstance(record.args, tuple)  # (failures in a row, delay)
        delay_s = record.args[1]
        assert isinstance(delay_s, float)
        delays_s.append(delay_s)
    return delays_s


async def _until(done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Let the loop run until `done()` holds; TimeoutError after `timeout_s` (a tenth of a slot)."""
    async with asyncio.timeout(timeout_s):
        while not done():
            await asyncio.sleep(0.01)


def test_a_failed_tick_is_retried_after_a_backoff_not_a_whole_slot(
    database_url: str,  # noqa: F811 (fixture)
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = _config(limit_kg=1.0, tick_retry_initial_s=0.2)
    # The first two ticks fail; the slot is 300 s, so only the backoff can retry within _until.
    carbon = _FailingCarbon(config, failures=2)
    loop = ControlLoop(config, factory, engine, carbon=carbon)

    async def run() -> tuple[list[float], list[float]]:
        loop._loop = asyncio.get_running_loop()
        ticking = asyncio.create_task(loop._tick_forever())
        try:
            await _until(lambda: loop.ticks == 1)
            first_delays_s = _retry_delays_s(caplog)
            # After a tick that worked, the backoff starts over; a wake still ticks at once.
            carbon.failures_left = 1
            loop.wake()
            await _until(lambda: loop.ticks == 2)
            return first_delays_s, _retry_delays_s(caplog)
        finally:
            await loop.stop()
            await ticking

    try:
        first_delays_s, delays_s = asyncio.run(run())
        assert first_delays_s == pytest.approx([0.2, 0.4])
        assert delays_s == pytest.approx([0.2, 0.4, 0.2])
        # Nothing woke the first retries: each waited its backoff out (1 ms: timer resolution).
        calls_s = carbon.calls_at_s
        assert len(calls_s) == 5
        assert calls_s[1] - calls_s[0] >= 0.2 - 1e-3 and calls_s[2] - calls_s[1] >= 0.4 - 1e-3
        # The retries then planned as usual: a forecast stored per tick that worked, none for
        # the three that failed, and the spend expectation the watchdog judges by.
        with transaction(factory) as session:
            stored = session.scalar(select(func.count(CarbonForecastRecord.id)))
        assert stored == 2
        assert loop._spend_expectation is not None
    finally:
        engine.dispose()


def test_a_failed_woken_tick_lets_the_watchdog_wake_it_again(
    database_url: str,  # noqa: F811 (fixture)
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = datetime.now(UTC)
    job_id = _running_job(factory, now)
    ends = [now - timedelta(seconds=55 - 5 * i) for i in range(12)]
    # The backoff is a whole slot: only the watchdog can bring the next tick within _until.
    config = _config(limit_kg=0.001, tick_retry_initial_s=300)
    carbon = _FailingCarbon(config, failures=0)
    loop = ControlLoop(config, factory, engine, carbon=carbon)

    async def run() -> tuple[str | None, str | None]:
        loop._loop = asyncio.get_running_loop()
        ticking = asyncio.create_task(loop._tick_forever())
        try:
            await _until(lambda: loop.ticks == 1)  # a plan made with nothing spent yet
            # 8 GPUs at 3 kW for half a minute: far over the 1 g budget. The watchdog wakes the
            # tick, and that tick fails (set before it runs: the wake is only scheduled yet).
            _report(factory, job_id, ends[:6])
            first = await loop.sample_carbon_once(60.0)
            carbon.failures_left = 1
            await _until(lambda: len(_tick_failures(caplog)) == 1)
            # The jobs spend on and the plan in force is still the one it woke the tick for.
            _report(factory, job_id, ends[6:])
            second = await loop.sample_carbon_once(60.0)
            assert second is not None, "the watchdog stayed quiet after the failed tick"
            await _until(lambda: loop.ticks == 2)
            return first, second
        finally:
            await loop.stop()
            await ticking

    try:
        first, second = asyncio.run(run())
        assert first is not None and "is spent" in first
        assert second is not None and "is spent" in second
        assert loop.budget_wakes == 2
        assert _retry_delays_s(caplog) == pytest.approx([300.0])
        # The tick the second wake started planned with the overspend seen.
        assert loop._spend_expectation is not None
        assert loop._spend_expectation.spent_at_plan_kg > 0.001
    finally:
        engine.dispose()
