"""Budget periods on a replay's carbon clock: the series' calendar, compressed (issue 22)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest

from energy_model.carbon.factory import CarbonConfig
from energy_model.carbon.trace import TraceProvider
from scheduler_service.budget import periods
from scheduler_service.budget.ledger import period_clock
from scheduler_service.budget.periods import (
    ReplayClock,
    period_containing,
    periods_between,
    replay_clock,
)
from scheduler_service.carbon.service import make_carbon_source
from scheduler_service.settings import GreenflowConfig

WALL0 = datetime(2026, 11, 28, 2, 0, tzinfo=UTC)
# The demo's speed (one series hour every 5 s of wall time), playing 2021-02-27 12:00 at WALL0.
REPLAY = ReplayClock(720.0, WALL0, datetime(2021, 2, 27, 12, tzinfo=UTC))


def _s(seconds: float) -> datetime:
    return WALL0 + timedelta(seconds=seconds)


def test_a_month_on_the_carbon_clock_is_the_series_calendar_month() -> None:
    # February 2021 began 26.5 series days (3,180 s of wall time) before the anchor and ends
    # 1.5 series days (180 s) after it: 28 days, 3,360 s.
    february = period_containing(WALL0, "month", "UTC", REPLAY)
    assert (february.start_at, february.end_at) == (_s(-3180), _s(180))
    # March has 31 days: 3,720 s; the next period starts exactly where the last one ended.
    march = period_containing(february.end_at, "month", "UTC", REPLAY)
    assert (march.start_at, march.end_at) == (_s(180), _s(180 + 3720))
    # A week runs from the series' Monday (2021-02-22) to the next.
    week = period_containing(WALL0, "week", "UTC", REPLAY)
    assert (week.start_at, week.end_at) == (_s(-5.5 * 120), _s(1.5 * 120))


def test_the_time_zone_applies_to_the_series_calendar() -> None:
    # 12:00 UTC on the series is 13:00 in Berlin (CET): the Berlin day began 13 series hours
    # (65 s) before the anchor and ends 11 series hours (55 s) after it.
    day = period_containing(WALL0, "day", "Europe/Berlin", REPLAY)
    assert (day.start_at, day.end_at) == (_s(-65), _s(55))


def test_periods_on_an_uneven_clock_tile_the_wall_time_exactly() -> None:
    clock = ReplayClock(7.3, WALL0, datetime(2021, 12, 30, 17, 13, 11, tzinfo=UTC))
    months = list(periods_between(WALL0, WALL0 + timedelta(days=60), "month", "UTC", clock))
    assert len(months) >= 5
    for before, after in pairwise(months):
        assert before.end_at == after.start_at
        # Each period is its calendar month's length / speed-up, to the microsecond.
        carbon = clock.to_carbon(after.start_at + timedelta(seconds=1))
        first = carbon.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        nxt = (first + timedelta(days=32)).replace(day=1)
        expected_s = (nxt - first).total_seconds() / 7.3
        assert (after.end_at - after.start_at).total_seconds() == pytest.approx(
            expected_s, abs=2e-6
        )
        # A period's end belongs to the next period, however the mapping rounds.
        assert period_containing(before.end_at, "month", "UTC", clock) == after


def test_the_replay_registers_its_carbon_clock_for_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(periods, "_replay", None)
    source = make_carbon_source(CarbonConfig(provider="synthetic", clock_speedup=720.0))
    provider = source.provider
    assert isinstance(provider, TraceProvider)
    clock = replay_clock()
    assert clock is not None and clock.speedup == 720.0
    # The clock plays the series where the replay does.
    later = provider.wall_start_at + timedelta(seconds=333)
    assert clock.to_carbon(later) == provider.series_start_at + timedelta(
        hours=provider.trace_hours_at(later)
    )
    config = GreenflowConfig.model_validate(
        {"carbon": {"provider": "synthetic", "clock_speedup": 720.0}}
    )
    # Budget periods use it only with `budget.period_clock = "carbon"`.
    assert period_clock(config) is None
    carbon = config.model_copy(
        update={"budget": config.budget.model_copy(update={"period_clock": "carbon"})}
    )
    assert period_clock(carbon) == clock
    # A provider that is not a replay has no carbon clock of its own: the wall clock's periods.
    make_carbon_source(CarbonConfig(provider="uk", region="national"))
    assert replay_clock() is None and period_clock(carbon) is None
