"""Emissions arithmetic with units in every name.

An intensity step series is a list of (start time, g CO2e/kWh) pairs: each value holds from its
time until the next one, and the last holds forever. Charging an interval splits it at every
step boundary and charges each part at its own intensity, so the result is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Protocol

SECONDS_PER_HOUR = 3600.0
WATTS_PER_KILOWATT = 1000.0
J_PER_KWH = SECONDS_PER_HOUR * WATTS_PER_KILOWATT  # 3.6e6 J in one kWh
GRAMS_PER_KG = 1000.0


class StepSeries(Protocol):
    """Anything with parallel `times` and `intensity_g_per_kwh` sequences (UTC, increasing)."""

    @property
    def times(self) -> Sequence[datetime]: ...

    @property
    def intensity_g_per_kwh(self) -> Sequence[float]: ...


def energy_kwh(power_w: float, duration_s: float) -> float:
    """Energy (kWh) of a constant `power_w` drawn for `duration_s` seconds."""
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    return power_w * duration_s / SECONDS_PER_HOUR / WATTS_PER_KILOWATT


def facility_energy_kwh(it_energy_kwh: float, pue: float) -> float:
    """Facility energy (kWh): IT energy times power usage effectiveness (PUE >= 1)."""
    if pue < 1.0:
        raise ValueError(f"PUE must be >= 1, got {pue}")
    return it_energy_kwh * pue


def emissions_g(energy_kwh_: float, intensity_g_per_kwh: float) -> float:
    """Grams CO2e of `energy_kwh_` at a constant intensity."""
    return energy_kwh_ * intensity_g_per_kwh


def interval_emissions_g(
    power_w: float,
    start_at: datetime,
    end_at: datetime,
    series: StepSeries,
    pue: float = 1.0,
) -> float:
    """Grams CO2e of constant `power_w` over [start_at, end_at), charged step by step."""
    return sum(
        emissions_g(facility_energy_kwh(energy_kwh(power_w, part_s), pue), intensity)
        for part_s, intensity in split_by_steps(start_at, end_at, series)
    )


def interval_emissions_kg(
    power_w: float,
    start_at: datetime,
    end_at: datetime,
    series: StepSeries,
    pue: float = 1.0,
) -> float:
    """Kilograms CO2e of constant `power_w` over [start_at, end_at) (see interval_emissions_g)."""
    return interval_emissions_g(power_w, start_at, end_at, series, pue) / GRAMS_PER_KG


def split_by_steps(
    start_at: datetime, end_at: datetime, series: StepSeries
) -> list[tuple[float, float]]:
    """(seconds, intensity) parts of [start_at, end_at) cut at every step boundary of `series`."""
    _check_aware(start_at, "start_at")
    _check_aware(end_at, "end_at")
    if end_at < start_at:
        raise ValueError(f"end_at {end_at.isoformat()} is before start_at {start_at.isoformat()}")
    times = list(series.times)
    values = list(series.intensity_g_per_kwh)
    if not times:
        raise ValueError("intensity series is empty")
    if start_at < times[0]:
        raise ValueError(
            f"interval starts at {start_at.isoformat()}, before the intensity series "
            f"({times[0].isoformat()}); no intensity is known there"
        )
    parts: list[tuple[float, float]] = []
    # Index of the step that holds at start_at (last time <= start_at).
    lo, hi = 0, len(times)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if times[mid] <= start_at:
            lo = mid
        else:
            hi = mid
    i = lo
    cursor = start_at
    while cursor < end_at:
        step_end = times[i + 1] if i + 1 < len(times) else end_at
        part_end = min(step_end, end_at)
        parts.append(((part_end - cursor).total_seconds(), float(values[i])))
        cursor = part_end
        i += 1
    return parts


def _check_aware(value: datetime, name: str) -> None:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware (UTC), got naive {value.isoformat()}")
