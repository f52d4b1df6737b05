"""Emissions arithmetic: exact step integration, units, PUE (property tests)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from energy_model.emissions import (
    energy_kwh,
    facility_energy_kwh,
    interval_emissions_g,
    interval_emissions_kg,
    split_by_steps,
)

T0 = datetime(2024, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Steps:
    times: tuple[datetime, ...]
    intensity_g_per_kwh: tuple[float, ...]


@st.composite
def step_series(draw: st.DrawFn) -> Steps:
    gaps = draw(st.lists(st.integers(1, 7200), min_size=0, max_size=8))
    values = draw(
        st.lists(
            st.floats(0, 1500, allow_nan=False), min_size=len(gaps) + 1, max_size=len(gaps) + 1
        )
    )
    times = [T0]
    for gap in gaps:
        times.append(times[-1] + timedelta(seconds=gap))
    return Steps(tuple(times), tuple(values))


def brute_force_g(power_w: float, start: datetime, end: datetime, s: Steps, pue: float) -> float:
    """Second-by-second reference (all test times are whole seconds)."""
    total = 0.0
    t = start
    while t < end:
        i = max(k for k, at in enumerate(s.times) if at <= t)
        total += power_w / 1000 / 3600 * pue * s.intensity_g_per_kwh[i]
        t += timedelta(seconds=1)
    return total


def test_energy_units() -> None:
    assert energy_kwh(1000.0, 3600.0) == pytest.approx(1.0)
    assert energy_kwh(300.0, 60.0) == pytest.approx(0.005)
    assert facility_energy_kwh(2.0, 1.5) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="PUE"):
        facility_energy_kwh(1.0, 0.9)
    with pytest.raises(ValueError, match="duration_s"):
        energy_kwh(1.0, -1.0)


def test_boundary_crossing_is_charged_per_part() -> None:
    s = Steps((T0, T0 + timedelta(hours=1)), (100.0, 500.0))
    start = T0 + timedelta(minutes=30)
    end = T0 + timedelta(minutes=90)
    # 1 kW for 30 min at 100 g/kWh + 30 min at 500 g/kWh = 50 + 250 g.
    assert interval_emissions_g(1000.0, start, end, s) == pytest.approx(300.0)
    assert interval_emissions_kg(1000.0, start, end, s, pue=1.2) == pytest.approx(0.36)


def test_rejects_naive_and_unknown_times() -> None:
    s = Steps((T0,), (100.0,))
    with pytest.raises(ValueError, match="timezone-aware"):
        interval_emissions_g(1.0, datetime(2024, 1, 1), datetime(2024, 1, 2), s)
    with pytest.raises(ValueError, match="before the intensity series"):
        interval_emissions_g(1.0, T0 - timedelta(hours=1), T0, s)
    with pytest.raises(ValueError, match="before start_at"):
        interval_emissions_g(1.0, T0 + timedelta(hours=1), T0, s)


@given(
    s=step_series(),
    power_w=st.floats(0, 5000, allow_nan=False),
    a=st.integers(0, 20000),
    length=st.integers(0, 20000),
    pue=st.floats(1.0, 2.0),
)
def test_matches_brute_force(s: Steps, power_w: float, a: int, length: int, pue: float) -> None:
    start = T0 + timedelta(seconds=a)
    end = start + timedelta(seconds=length)
    if length > 3000:  # keep the reference loop short; the additivity test covers long ones
        end = start + timedelta(seconds=3000)
    exact = interval_emissions_g(power_w, start, end, s, pue)
    assert exact == pytest.approx(brute_force_g(power_w, start, end, s, pue), rel=1e-9, abs=1e-9)


@given(
    s=step_series(),
    power_w=st.floats(0, 5000, allow_nan=False),
    a=st.integers(0, 40000),
    b=st.integers(0, 40000),
    c=st.integers(0, 40000),
)
def test_additive_over_split_points(s: Steps, power_w: float, a: int, b: int, c: int) -> None:
    t1, t2, t3 = (T0 + timedelta(seconds=x) for x in sorted((a, b, c)))
    whole = interval_emissions_g(power_w, t1, t3, s)
    parts = interval_emissions_g(power_w, t1, t2, s) + interval_emissions_g(power_w, t2, t3, s)
    assert whole == pytest.approx(parts, rel=1e-9, abs=1e-9)


@given(s=step_series(), a=st.integers(0, 40000), length=st.integers(0, 40000))
def test_parts_cover_the_interval_and_bounds(s: Steps, a: int, length: int) -> None:
    start = T0 + timedelta(seconds=a)
    end = start + timedelta(seconds=length)
    parts = split_by_steps(start, end, s)
    assert sum(p for p, _ in parts) == pytest.approx(length)
    g = interval_emissions_g(1000.0, start, end, s)
    kwh = energy_kwh(1000.0, length)
    assert min(s.intensity_g_per_kwh) * kwh - 1e-9 <= g <= max(s.intensity_g_per_kwh) * kwh + 1e-9


@given(
    s=step_series(),
    power_w=st.floats(0, 5000, allow_nan=False),
    k=st.floats(0, 10, allow_nan=False),
    pue=st.floats(1.0, 3.0),
)
def test_linear_in_power_and_pue(s: Steps, power_w: float, k: float, pue: float) -> None:
    start, end = T0, T0 + timedelta(hours=5)
    base = interval_emissions_g(power_w, start, end, s)
    assert interval_emissions_g(k * power_w, start, end, s) == pytest.approx(k * base, abs=1e-6)
    assert interval_emissions_g(power_w, start, end, s, pue) == pytest.approx(pue * base, abs=1e-6)
