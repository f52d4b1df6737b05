"""Budget periods (day, week, month) as UTC intervals."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

PeriodKind = Literal["day", "week", "month"]


@dataclass(frozen=True)
class BudgetPeriod:
    """One budget period [start_at, end_at) in UTC."""

    start_at: datetime
    end_at: datetime


def period_containing(at: datetime, kind: PeriodKind) -> BudgetPeriod:
    """The day (from 00:00 UTC), week (from Monday) or month that contains `at`."""
    at = at.astimezone(UTC)
    day = at.replace(hour=0, minute=0, second=0, microsecond=0)
    if kind == "day":
        return BudgetPeriod(day, day + timedelta(days=1))
    if kind == "week":
        start = day - timedelta(days=day.weekday())
        return BudgetPeriod(start, start + timedelta(days=7))
    start = day.replace(day=1)
    end = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )
    return BudgetPeriod(start, end)


def periods_between(
    start_at: datetime, end_at: datetime, kind: PeriodKind
) -> Iterator[BudgetPeriod]:
    """Every period that overlaps [start_at, end_at)."""
    period = period_containing(start_at, kind)
    while period.start_at < end_at:
        yield period
        period = period_containing(period.end_at, kind)


def split_interval(
    start_at: datetime, end_at: datetime, kind: PeriodKind
) -> list[tuple[BudgetPeriod, datetime, datetime]]:
    """[start_at, end_at) cut at period boundaries: (period, part start, part end) triples."""
    parts = []
    for period in periods_between(start_at, end_at, kind):
        lo, hi = max(start_at, period.start_at), min(end_at, period.end_at)
        if hi > lo:
            parts.append((period, lo, hi))
    return parts
