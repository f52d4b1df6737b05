"""Budget periods (day, week, month) of a time zone, as UTC intervals, on the wall clock or a
replay's carbon clock."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Literal
from zoneinfo import ZoneInfo

PeriodKind = Literal["day", "week", "month"]


@dataclass(frozen=True)
class BudgetPeriod:
    """One budget period [start_at, end_at), as UTC instants."""

    start_at: datetime
    end_at: datetime


@dataclass(frozen=True)
class PeriodStatus:
    """A budget period with what it allows and what has been spent."""

    start_at: datetime
    end_at: datetime
    limit_kg: float
    spent_kg: float
    energy_kwh: float
    # Kept back for what the nodes draw besides the jobs (idle GPUs, hosts) until the period
    # ends; set only on the statuses the planner plans against.
    reserved_kg: float = 0.0

    @property
    def left_kg(self) -> float:
        """Budget not yet spent nor reserved (never negative)."""
        return max(0.0, self.limit_kg - self.spent_kg - self.reserved_kg)


def _local_midnight(day: date, zone: ZoneInfo) -> datetime:
    """00:00 of `day` in `zone`, as a UTC instant."""
    return datetime(day.year, day.month, day.day, tzinfo=zone).astimezone(UTC)


@dataclass(frozen=True)
class ReplayClock:
    """The carbon clock of a replay: the series instant `carbon_anchor_at` plays at the wall
    instant `wall_anchor_at`, and series time runs `speedup` times faster than the wall's (it
    keeps counting past the series' end when the replay loops, so the calendar goes on)."""

    speedup: float
    wall_anchor_at: datetime
    carbon_anchor_at: datetime

    def to_carbon(self, wall_at: datetime) -> datetime:
        """The series instant playing at `wall_at`."""
        wall_us = (wall_at - self.wall_anchor_at) // timedelta(microseconds=1)
        return self.carbon_anchor_at + timedelta(microseconds=round(wall_us * self.speedup))

    def to_wall(self, carbon_at: datetime) -> datetime:
        """The wall instant at which the replay reaches `carbon_at` (whole microseconds, so a
        period's end is exactly the next one's start)."""
        carbon_us = (carbon_at - self.carbon_anchor_at) // timedelta(microseconds=1)
        return self.wall_anchor_at + timedelta(microseconds=round(carbon_us / self.speedup))


_replay: ReplayClock | None = None


def register_replay_clock(clock: ReplayClock | None) -> None:
    """Set the carbon clock of the replay this process runs (`make_carbon_source`; None: none)."""
    global _replay
    _replay = clock


def replay_clock() -> ReplayClock | None:
    """The carbon clock of the replay this process runs, if any."""
    return _replay


def _calendar_period(at: datetime, kind: PeriodKind, time_zone: str) -> BudgetPeriod:
    """The calendar day, week (from Monday) or month of `time_zone` holding `at`, in UTC."""
    zone = ZoneInfo(time_zone)
    local = at.astimezone(zone).date()
    if kind == "day":
        first, after = local, local + timedelta(days=1)
    elif kind == "week":
        first = local - timedelta(days=local.weekday())
        after = first + timedelta(days=7)
    else:
        first = local.replace(day=1)
        after = (
            first.replace(year=first.year + 1, month=1)
            if first.month == 12
            else first.replace(month=first.month + 1)
        )
    return BudgetPeriod(_local_midnight(first, zone), _local_midnight(after, zone))


def period_containing(
    at: datetime, kind: PeriodKind, time_zone: str = "UTC", clock: ReplayClock | None = None
) -> BudgetPeriod:
    """The day (from local midnight), week (from Monday) or month of `time_zone` that contains
    `at`, as UTC instants (a DST day is 23 or 25 hours long). With a replay's carbon `clock`
    (`budget.period_clock = "carbon"`) the calendar is the replay's: the period is the calendar
    day, week or month of the series instant playing at `at`, mapped back to wall instants, so a
    compressed replay's month lasts its 28-31 series days / speedup of wall time."""
    if clock is None:
        return _calendar_period(at, kind, time_zone)
    period = _calendar_period(clock.to_carbon(at), kind, time_zone)
    start, end = clock.to_wall(period.start_at), clock.to_wall(period.end_at)
    # The wall <-> series mapping rounds to microseconds: at a boundary, step to the neighbour.
    while at >= end:
        period = _calendar_period(period.end_at, kind, time_zone)
        start, end = end, clock.to_wall(period.end_at)
    while at < start:
        period = _calendar_period(period.start_at - timedelta(microseconds=1), kind, time_zone)
        start, end = clock.to_wall(period.start_at), start
    return BudgetPeriod(start, end)


def periods_between(
    start_at: datetime,
    end_at: datetime,
    kind: PeriodKind,
    time_zone: str = "UTC",
    clock: ReplayClock | None = None,
) -> Iterator[BudgetPeriod]:
    """Every period that overlaps [start_at, end_at)."""
    period = period_containing(start_at, kind, time_zone, clock)
    while period.start_at < end_at:
        yield period
        period = period_containing(period.end_at, kind, time_zone, clock)


def split_interval(
    start_at: datetime,
    end_at: datetime,
    kind: PeriodKind,
    time_zone: str = "UTC",
    clock: ReplayClock | None = None,
) -> list[tuple[BudgetPeriod, datetime, datetime]]:
    """[start_at, end_at) cut at period boundaries: (period, part start, part end) triples."""
    parts = []
    for period in periods_between(start_at, end_at, kind, time_zone, clock):
        lo, hi = max(start_at, period.start_at), min(end_at, period.end_at)
        if hi > lo:
            parts.append((period, lo, hi))
    return parts
