"""Replay an intensity series (CSV file or in-memory) on a real or compressed clock.

Trace time advances `clock_speedup` times faster than the wall clock, starting at
`start_offset_h` hours into the series when the provider is created; the trace loops at its end.
Forecast points are stamped in wall-clock time, so a compressed replay yields compressed slots.
By default the future is forecast by the library's forecaster from the replayed past (a
scheduler should not see the future); `forecast_mode="oracle"` returns the trace's own values.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

import numpy as np

from energy_model.carbon.base import Clock, utc_now
from energy_model.carbon.errors import ProviderConfigError
from energy_model.carbon.forecast import CarbonForecast, ForecastPoint, PointKind, Signal
from energy_model.carbon.forecaster import FIT_WINDOW_H, HOUR_S, forecast_hourly, to_hourly
from energy_model.carbon.series import IntensitySeries, load_intensity_csv

ForecastMode = Literal["model", "oracle"]
# Replay history the model sees: its whole fit window, so it can fit from the first tick.
HISTORY_H = FIT_WINDOW_H
# No real provider forecasts further than 72 h; a compressed replay stops there too.
MAX_FORECAST_H = 72


class TraceProvider:
    """Replays an hourly intensity series as if it were live."""

    name = "trace"

    def __init__(
        self,
        series: IntensitySeries,
        region: str = "trace",
        clock_speedup: float = 1.0,
        start_offset_h: int | None = None,
        forecast_mode: ForecastMode = "model",
        signal: Signal = Signal.AVERAGE_LCA,
        clock: Clock = utc_now,
        source: str | None = None,
    ) -> None:
        if clock_speedup <= 0:
            raise ProviderConfigError(self.name, f"clock_speedup must be > 0, got {clock_speedup}")
        self.region = region
        self.clock = clock
        self.clock_speedup = clock_speedup
        self.forecast_mode = forecast_mode
        self.signal = signal
        self.source = source or f"trace:{series.source}"
        self.series_start_at, self.values = to_hourly(series)
        n = len(self.values)
        if start_offset_h is None:
            # Start after enough history for the forecaster when the trace has it.
            start_offset_h = min(HISTORY_H, n // 2)
        self.start_offset_h = start_offset_h % n
        self.wall_start_at = clock()

    @classmethod
    def from_file(cls, path: Path, **kwargs: object) -> TraceProvider:
        """A replay of a CSV file (Electricity Maps export or `time,intensity`)."""
        if not path.is_file():
            raise ProviderConfigError(cls.name, f"trace file {path} does not exist")
        try:
            series = load_intensity_csv(path)
        except ValueError as exc:
            raise ProviderConfigError(cls.name, f"cannot read trace {path}: {exc}") from exc
        return cls(series, **kwargs)  # type: ignore[arg-type]

    def trace_hours_at(self, wall_at: datetime) -> float:
        """Position in the trace (hours from its start, not wrapped) at a wall-clock time."""
        elapsed_s = (wall_at - self.wall_start_at).total_seconds() * self.clock_speedup
        return self.start_offset_h + elapsed_s / HOUR_S

    @property
    def series_anchor_at(self) -> datetime:
        """The series instant that played at `wall_start_at` (the replay's carbon clock there)."""
        return self.series_start_at + timedelta(hours=self.start_offset_h)

    def wall_at(self, trace_hours: float) -> datetime:
        """Wall-clock time at which the replay reaches `trace_hours`."""
        wall_s = (trace_hours - self.start_offset_h) * HOUR_S / self.clock_speedup
        return self.wall_start_at + timedelta(seconds=wall_s)

    def _value(self, hour_index: int) -> float:
        return float(self.values[hour_index % len(self.values)])

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        """Intensity now and over `horizon_s` wall seconds of the replay."""
        now = self.clock()
        pos_h = self.trace_hours_at(now)
        current = math.floor(pos_h)
        horizon_h = min(MAX_FORECAST_H, max(1, math.ceil(horizon_s * self.clock_speedup / HOUR_S)))
        points = [
            ForecastPoint(at=now, intensity_g_per_kwh=self._value(current), kind=PointKind.MEASURED)
        ]
        if self.forecast_mode == "oracle":
            future = np.asarray([self._value(current + h) for h in range(1, horizon_h + 1)])
            method = "oracle"
        else:
            # Before the first loop the past stops at the trace start; later it wraps.
            lo = max(0, current - HISTORY_H + 1) if current < HISTORY_H else current - HISTORY_H + 1
            history = np.asarray([self._value(i) for i in range(lo, current + 1)])
            future, method = forecast_hourly(history, horizon_h)
        end = now + timedelta(seconds=horizon_s)
        for h, value in enumerate(future, start=1):
            at = self.wall_at(current + h)
            if at >= end:
                break
            points.append(
                ForecastPoint(
                    at=at, intensity_g_per_kwh=max(float(value), 0.0), kind=PointKind.FORECAST
                )
            )
        return CarbonForecast(
            region=self.region,
            source=f"{self.source} (forecast: {method}, speedup {self.clock_speedup:g}x)",
            signal=self.signal,
            fetched_at=now,
            points=tuple(points),
        )

    async def aclose(self) -> None:
        """Nothing to release."""
