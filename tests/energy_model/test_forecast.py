"""CarbonForecast, forecasters, trace/synthetic replay."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from energy_model.carbon import CarbonForecast, ForecastPoint, PointKind, Signal
from energy_model.carbon.errors import ProviderConfigError
from energy_model.carbon.forecast import window_points
from energy_model.carbon.forecaster import (
    HourlyRidgeForecaster,
    forecast_hourly,
    seasonal_naive,
    to_hourly,
)
from energy_model.carbon.series import IntensitySeries
from energy_model.carbon.synthetic import synthetic_series
from energy_model.carbon.trace import TraceProvider
from energy_model.emissions import interval_emissions_g
from tests.energy_model.conftest import FakeClock

T0 = datetime(2024, 1, 1, tzinfo=UTC)


def point(h: float, v: float, kind: PointKind = PointKind.FORECAST) -> ForecastPoint:
    return ForecastPoint(at=T0 + timedelta(hours=h), intensity_g_per_kwh=v, kind=kind)


def test_forecast_validation_and_lookup() -> None:
    f = CarbonForecast(
        region="X",
        source="test",
        signal=Signal.AVERAGE_LCA,
        fetched_at=T0,
        points=(point(0, 100, PointKind.MEASURED), point(1, 200), point(2, 50)),
    )
    assert f.intensity_at(T0 + timedelta(minutes=90)) == 200
    assert f.intensity_at(T0 + timedelta(hours=10)) == 50
    with pytest.raises(ValueError, match="before the forecast"):
        f.intensity_at(T0 - timedelta(seconds=1))
    # A forecast is a step series: the emissions arithmetic accepts it directly.
    g = interval_emissions_g(1000.0, T0, T0 + timedelta(hours=2), f)
    assert g == pytest.approx(300.0)
    degraded = f.as_degraded("provider down")
    assert degraded.degraded and degraded.degraded_reason == "provider down"
    with pytest.raises(ValidationError):
        CarbonForecast(
            region="X",
            source="t",
            signal=Signal.AVERAGE,
            fetched_at=T0,
            points=(point(1, 1), point(0, 1)),
        )
    with pytest.raises(ValidationError):
        ForecastPoint(at=datetime(2024, 1, 1), intensity_g_per_kwh=1, kind=PointKind.MEASURED)


def test_window_points_restamps_now() -> None:
    pts = (point(0, 1), point(1, 2), point(2, 3), point(3, 4))
    now = T0 + timedelta(minutes=70)
    out = window_points(pts, now, 3600)
    assert [p.intensity_g_per_kwh for p in out] == [2, 3]
    assert out[0].at == now


def test_seasonal_naive_repeats_yesterday() -> None:
    history = np.arange(48, dtype=float)
    assert seasonal_naive(history, 3).tolist() == [24.0, 25.0, 26.0]
    assert seasonal_naive(history, 26)[24:].tolist() == [24.0, 25.0]  # two days back past 24 h


def test_ridge_learns_a_periodic_series_and_beats_naive() -> None:
    rng = np.random.default_rng(1)
    hours = np.arange(24 * 70)
    level = 300 * np.exp(np.cumsum(rng.normal(0, 0.03, len(hours))) * 0.2)
    y = level * (1 - 0.3 * np.clip(np.cos((hours % 24 - 12) / 12 * np.pi), 0, None))
    train, test_start = y[: 24 * 56], 24 * 56
    model = HourlyRidgeForecaster(horizon_h=24).fit(train)
    origins = np.arange(test_start, len(y) - 24)
    truth = y[origins[:, None] + np.arange(1, 25)[None, :]]
    pred = model.predict_many(y, origins)
    naive = np.asarray([seasonal_naive(y[: o + 1], 24) for o in origins])
    mape_model = np.mean(np.abs(pred - truth) / truth)
    mape_naive = np.mean(np.abs(naive - truth) / truth)
    assert mape_model < mape_naive
    assert model.predict(y[: test_start + 1]).shape == (24,)


def test_forecast_hourly_picks_a_method_by_history() -> None:
    assert forecast_hourly([100.0], 3)[1] == "persistence"
    assert forecast_hourly(np.full(30, 100.0), 3)[1] == "seasonal_naive_24h"
    values, method = forecast_hourly(synthetic_series(days=60).intensity_g_per_kwh, 24)
    assert method == "ridge" and values.shape == (24,) and np.all(values > 0)
    with pytest.raises(ValueError):
        forecast_hourly([], 3)


def test_synthetic_series_is_seeded_and_has_a_solar_dip() -> None:
    a = synthetic_series(days=30, seed=7)
    b = synthetic_series(days=30, seed=7)
    c = synthetic_series(days=30, seed=8)
    assert a.intensity_g_per_kwh == b.intensity_g_per_kwh
    assert a.intensity_g_per_kwh != c.intensity_g_per_kwh
    y = np.asarray(a.intensity_g_per_kwh).reshape(30, 24)
    assert y[:, 12].mean() < 0.85 * y[:, 0].mean()  # midday cleaner than midnight
    daily = y.mean(axis=1)
    assert daily.std() / daily.mean() > 0.05  # weather moves the level from day to day


def test_to_hourly_holds_values_over_gaps() -> None:
    s = IntensitySeries((T0, T0 + timedelta(hours=3)), (10.0, 40.0), "x")
    start, y = to_hourly(s)
    assert start == T0 and y.tolist() == [10.0, 10.0, 10.0, 40.0]


async def test_trace_replay_on_a_compressed_clock(clock: FakeClock) -> None:
    series = IntensitySeries(
        tuple(T0 + timedelta(hours=h) for h in range(200)), tuple(float(h) for h in range(200)), "t"
    )
    p = TraceProvider(
        series, clock_speedup=60.0, start_offset_h=10, forecast_mode="oracle", clock=clock
    )
    f = await p.get_forecast(5 * 60)  # 5 wall minutes = 5 trace hours
    assert [pt.intensity_g_per_kwh for pt in f.points] == [10, 11, 12, 13, 14]
    assert f.points[0].kind == PointKind.MEASURED and f.points[1].kind == PointKind.FORECAST
    assert f.points[1].at - f.points[0].at == timedelta(minutes=1)
    clock.advance(90)  # 1.5 trace hours later
    f = await p.get_forecast(120)
    assert f.now_g_per_kwh == 11
    assert f.points[1].at == clock.now + timedelta(seconds=30)
    clock.advance(200 * 60)  # past the end: the trace loops
    f = await p.get_forecast(60)
    assert f.now_g_per_kwh == 11


async def test_trace_model_mode_does_not_peek(clock: FakeClock) -> None:
    series = synthetic_series(days=90, seed=3)
    p = TraceProvider(series, clock_speedup=1.0, clock=clock)
    f = await p.get_forecast(24 * 3600)
    assert "ridge" in f.source
    pos = p.start_offset_h
    future = series.intensity_g_per_kwh[pos + 1 : pos + 24]
    # Close to the truth on average, but not the truth.
    err = np.mean(np.abs(np.asarray(f.intensity_g_per_kwh[1:24]) - future) / future)
    assert 0 < err < 0.3


def test_trace_from_file(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("time,intensity\n2024-01-01T00:00:00Z,100\n2024-01-01T01:00:00Z,120\n")
    p = TraceProvider.from_file(path, clock=clock)
    assert p.values.tolist() == [100.0, 120.0]
    with pytest.raises(ProviderConfigError, match="does not exist"):
        TraceProvider.from_file(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ProviderConfigError, match="cannot read trace"):
        TraceProvider.from_file(bad)


async def test_trace_replays_real_series(shared_data: Path, clock: FakeClock) -> None:
    path = shared_data / "carbon" / "electricitymaps" / "US-CAL-CISO_2022_hourly.csv"
    p = TraceProvider.from_file(path, region="US-CAL-CISO", clock=clock)
    f = await p.get_forecast(24 * 3600)
    assert f.region == "US-CAL-CISO" and len(f.points) == 24
    assert all(0 < v < 1000 for v in f.intensity_g_per_kwh)
