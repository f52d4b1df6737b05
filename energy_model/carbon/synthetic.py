"""A seeded synthetic intensity series: the embedded default, with no third-party data.

Shape: a base level, a midday solar dip (deeper on sunny days), weather-like multi-day swings
(an AR(1) process on the hourly log-intensity, correlation time ~1.5 days), slightly cleaner
weekends, and small hourly noise.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import numpy as np

from energy_model.carbon.base import Clock, utc_now
from energy_model.carbon.forecast import Signal
from energy_model.carbon.series import IntensitySeries
from energy_model.carbon.trace import ForecastMode, TraceProvider

SYNTHETIC_EPOCH = datetime(2025, 1, 1, tzinfo=UTC)


def synthetic_series(
    days: int = 120,
    seed: int = 0,
    base_g_per_kwh: float = 350.0,
    solar_dip_fraction: float = 0.35,
    weather_std: float = 0.18,
    solar_noon_utc_h: float = 12.0,
    start_at: datetime = SYNTHETIC_EPOCH,
) -> IntensitySeries:
    """Hourly synthetic intensity (g CO2e/kWh) for `days` days, reproducible from `seed`."""
    if days <= 0:
        raise ValueError(f"days must be positive, got {days}")
    rng = np.random.default_rng(seed)
    n = days * 24
    hours = np.arange(n)
    hour_of_day = hours % 24
    # Solar output: a half-cosine between 6 h before and after solar noon.
    phase = (hour_of_day - solar_noon_utc_h) / 12.0 * math.pi
    solar = np.clip(np.cos(phase), 0.0, None) ** 1.5
    sunny = np.clip(rng.normal(0.8, 0.25, size=days), 0.1, 1.2).repeat(24)
    phi = math.exp(-1.0 / 36.0)
    shocks = rng.normal(0.0, weather_std * math.sqrt(1 - phi * phi), size=n)
    weather = np.empty(n)
    weather[0] = rng.normal(0.0, weather_std)
    for i in range(1, n):
        weather[i] = phi * weather[i - 1] + shocks[i]
    weekday = np.asarray(
        [(start_at + timedelta(hours=int(h))).weekday() for h in range(0, n, 24)]
    ).repeat(24)
    weekend = np.where(weekday >= 5, 0.93, 1.0)
    noise = rng.normal(0.0, 0.02, size=n)
    values = (
        base_g_per_kwh
        * (1 - solar_dip_fraction * solar * sunny)
        * weekend
        * np.exp(weather + noise)
    )
    values = np.clip(values, 20.0, None)
    times = tuple(start_at + timedelta(hours=int(h)) for h in hours)
    return IntensitySeries(times, tuple(float(v) for v in values), source=f"synthetic(seed={seed})")


class SyntheticProvider(TraceProvider):
    """The embedded default: replays a seeded synthetic series (labelled synthetic)."""

    name = "synthetic"

    def __init__(
        self,
        region: str = "synthetic",
        seed: int = 0,
        clock_speedup: float = 1.0,
        forecast_mode: ForecastMode = "model",
        clock: Clock = utc_now,
        days: int = 120,
    ) -> None:
        super().__init__(
            synthetic_series(days=days, seed=seed),
            region=region,
            clock_speedup=clock_speedup,
            forecast_mode=forecast_mode,
            signal=Signal.AVERAGE_LCA,
            clock=clock,
            source=f"synthetic(seed={seed})",
        )
