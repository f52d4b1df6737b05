"""The failure policy, in one place.

A provider error falls back to the last good forecast while it is younger than `max_age_s`
(re-windowed to start now; beyond its end the conservative intensity is assumed), then to a
flat `conservative_intensity_g_per_kwh`. Either way the forecast says it is degraded and why.
A good forecast shorter than the horizon is extended with the local forecaster from the
measured history this source has seen, or else with the conservative value; never cleaner.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import numpy as np

from energy_model.carbon.base import CarbonProvider, Clock, utc_now
from energy_model.carbon.errors import CarbonProviderError
from energy_model.carbon.forecast import (
    CarbonForecast,
    ForecastPoint,
    PointKind,
    Signal,
    window_points,
)
from energy_model.carbon.forecaster import forecast_hourly, to_hourly
from energy_model.carbon.series import IntensitySeries

log = logging.getLogger(__name__)

HISTORY_POINTS = 24 * 7 * 9  # about 9 weeks of hourly observations
MAX_EXTENSION_STEPS = 24 * 7  # extend a short forecast by at most this many steps


class ResilientCarbonSource:
    """Wraps a provider with a cache, a maximum forecast age and a conservative fallback."""

    def __init__(
        self,
        provider: CarbonProvider,
        conservative_intensity_g_per_kwh: float,
        max_forecast_age_s: float = 6 * 3600,
        clock: Clock = utc_now,
    ) -> None:
        if conservative_intensity_g_per_kwh <= 0:
            raise ValueError(
                "conservative_intensity_g_per_kwh must be positive "
                f"(got {conservative_intensity_g_per_kwh})"
            )
        self.provider = provider
        self.conservative_intensity_g_per_kwh = conservative_intensity_g_per_kwh
        self.max_forecast_age_s = max_forecast_age_s
        self.clock = clock
        self.last_good: CarbonForecast | None = None
        self.last_error: CarbonProviderError | None = None
        # Measured/estimated intensity per whole UTC hour (latest value seen in that hour).
        self.history: dict[datetime, float] = {}

    @property
    def name(self) -> str:
        """The wrapped provider's name."""
        return str(getattr(self.provider, "name", "provider"))

    @property
    def region(self) -> str:
        """The wrapped provider's region."""
        return self.provider.region

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        """A forecast over [now, now + horizon_s]; degraded (with a reason) when it had to fall back."""
        now = self.clock()
        try:
            fresh = await self.provider.get_forecast(horizon_s)
        except CarbonProviderError as exc:
            self.last_error = exc
            log.warning("carbon provider failed: %s", exc)
            return self._fallback(now, horizon_s, exc)
        self.last_error = None
        self._remember(fresh)
        self.last_good = fresh
        return self._extend(fresh, now, horizon_s)

    async def aclose(self) -> None:
        """Close the wrapped provider."""
        await self.provider.aclose()

    def _remember(self, forecast: CarbonForecast) -> None:
        for point in forecast.points:
            if point.kind == PointKind.FORECAST:
                continue
            hour = point.at.replace(minute=0, second=0, microsecond=0)
            self.history[hour] = point.intensity_g_per_kwh
        for hour in sorted(self.history)[:-HISTORY_POINTS]:
            del self.history[hour]

    def history_hourly(self) -> list[float]:
        """The remembered history on a contiguous hourly grid (gaps hold the previous value)."""
        if not self.history:
            return []
        hours = sorted(self.history)
        series = IntensitySeries(tuple(hours), tuple(self.history[h] for h in hours), "history")
        return [float(v) for v in to_hourly(series)[1]]

    def _extend(self, forecast: CarbonForecast, now: datetime, horizon_s: int) -> CarbonForecast:
        """Fill the horizon past the provider's last point (forecaster, else conservative)."""
        end = now + timedelta(seconds=horizon_s)
        last = forecast.points[-1]
        # Continue at the forecast's own step (an hour, or less on a compressed trace clock).
        step_s = 3600.0
        if len(forecast.points) >= 2:
            step_s = max(60.0, (last.at - forecast.points[-2].at).total_seconds())
        gap_s = (end - last.at).total_seconds()
        if gap_s <= step_s:
            return forecast
        hours = min(MAX_EXTENSION_STEPS, int(gap_s // step_s))
        values = self.history_hourly()
        if len(values) >= 24:
            future, method = forecast_hourly(np.asarray(values), hours)
            kind_note = f"extended past {last.at:%Y-%m-%d %H:%M}Z with local {method}"
        else:
            future = np.full(hours, self.conservative_intensity_g_per_kwh)
            kind_note = (
                f"extended past {last.at:%Y-%m-%d %H:%M}Z with the conservative "
                f"{self.conservative_intensity_g_per_kwh:g} g/kWh"
            )
        extra = [
            ForecastPoint(
                at=last.at + timedelta(hours=h),
                intensity_g_per_kwh=float(v),
                kind=PointKind.FORECAST,
            )
            for h, v in enumerate(future, start=1)
            if last.at + timedelta(seconds=h * step_s) < end
        ]
        return forecast.model_copy(
            update={
                "points": (*forecast.points, *extra),
                "source": f"{forecast.source}; {kind_note}",
            }
        )

    def _fallback(self, now: datetime, horizon_s: int, exc: CarbonProviderError) -> CarbonForecast:
        cached = self.last_good
        if cached is not None:
            age_s = (now - cached.fetched_at).total_seconds()
            if age_s <= self.max_forecast_age_s:
                points = list(window_points(cached.points, now, horizon_s))
                # Beyond what the cache knew, assume the conservative value, never cleaner.
                end_known = cached.points[-1].at + timedelta(hours=1)
                if end_known < now + timedelta(seconds=horizon_s):
                    points.append(
                        ForecastPoint(
                            at=max(end_known, points[-1].at + timedelta(seconds=1)),
                            intensity_g_per_kwh=self.conservative_intensity_g_per_kwh,
                            kind=PointKind.ESTIMATED,
                        )
                    )
                return cached.model_copy(
                    update={
                        "points": tuple(points),
                        "degraded": True,
                        "degraded_reason": (
                            f"{exc}; using the forecast fetched {age_s:.0f} s ago "
                            f"(max age {self.max_forecast_age_s:.0f} s)"
                        ),
                    }
                )
            reason = (
                f"{exc}; the last good forecast is {age_s:.0f} s old (max "
                f"{self.max_forecast_age_s:.0f} s); assuming the conservative "
                f"{self.conservative_intensity_g_per_kwh:g} g/kWh"
            )
        else:
            reason = (
                f"{exc}; no earlier forecast; assuming the conservative "
                f"{self.conservative_intensity_g_per_kwh:g} g/kWh"
            )
        signal = cached.signal if cached is not None else Signal.AVERAGE
        return CarbonForecast(
            region=self.provider.region,
            source=f"{getattr(self.provider, 'name', 'provider')} (conservative fallback)",
            signal=signal,
            fetched_at=now,
            points=(
                ForecastPoint(
                    at=now,
                    intensity_g_per_kwh=self.conservative_intensity_g_per_kwh,
                    kind=PointKind.ESTIMATED,
                ),
            ),
            degraded=True,
            degraded_reason=reason,
        )
