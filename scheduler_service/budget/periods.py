"""Budget periods (day, week, month) of a time zone, as UTC intervals."""

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


# Days per period on a compressed carbon clock (a replay has no calendar: a month is 30 days).
_COMPRESSED_DAYS = {"day": 1, "week": 7, "month": 30}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _compressed_period(at: datetime, kind: PeriodKind, speedup: float) -> BudgetPeriod:
    """The period holding `at` when the carbon clock runs `speedup` times faster than the wall:
    a day lasts 86,400 s / speedup of wall time, counted from the Unix epoch (integer
    microseconds, so a period's end is exactly the next one's start)."""
    length_us = max(1, round(_COMPRESSED_DAYS[kind] * 86_400e6 / speedup))
    since_us = (at - _EPOCH) // timedelta(microseconds=1)
    start = _EPOCH + timedelta(microseconds=(since_us // length_us) * length_us)
    return BudgetPeriod(start, start + timedelta(microseconds=length_us))


def period_containing(
    at: datetime, kind: PeriodKind, time_zone: str = "UTC", speedup: float = 1.0
) -> BudgetPeriod:
    """The day (from local midnight), week (from Monday) or month of `time_zone` that contains
    `at`, as UTC instants (a DST day is 23 or 25 hours long). With a carbon clock `speedup`
    times faster than the wall clock (`carbon.clock_speedup`, a compressed replay) periods are
    compressed the same way, so a budget "day" is the replay's day (`_compressed_period`; the
    time zone does not apply)."""
    if speedup != 1.0:
        return _compressed_period(at, kind, speedup)
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


def periods_between(
    start_at: datetime,
    end_at: datetime,
    kind: PeriodKind,
    time_zone: str = "UTC",
    speedup: float = 1.0,
) -> Iterator[BudgetPeriod]:
    """Every period that overlaps [start_at, end_at)."""
    period = period_containing(start_at, kind, time_zone, speedup)
    while period.start_at < end_at:
        yield period
        period = period_containing(period.end_at, kind, time_zone, speedup)


def split_interval(
    start_at: datetime,
    end_at: datetime,
    kind: PeriodKind,
    time_zone: str = "UTC",
    speedup: float = 1.0,
) -> list[tuple[BudgetPeriod, datetime, datetime]]:
    """[start_at, end_at) cut at period boundaries: (period, part start, part end) triples."""
    parts = []
    for period in periods_between(start_at, end_at, kind, time_zone, speedup):
        lo, hi = max(start_at, period.start_at), min(end_at, period.end_at)
        if hi > lo:
            parts.append((period, lo, hi))
    return parts
