"""The failure policy, in one place.

A provider error falls back to the last good forecast while it is younger than `max_age_s`
(re-windowed to start now; beyond its end the conservative intensity is assumed), then to a
flat `conservative_intensity_g_per_kwh`. Either way the forecast says it is degraded and why.
A good forecast shorter than the horizon is extended with the local forecaster from the
measured history this source has seen, or else with the conservative value; never cleaner.

Where the provider forecasts itself (Electricity Maps, WattTime, UK NESO, Carbon Aware SDK),
its forecast is blended with our forecaster's hour by hour, weighted by the skill each has
shown at that horizon on the hours observed since (`skill.ForecastSkill`); until both have
been scored often enough the provider's forecast stands. Every forecast point also carries an
upper quantile (default the 80th percentile) from the measured error of the forecasts this
source handed out, which a hard budget plans with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
from energy_model.carbon.skill import HOUR, ForecastSkill, floor_hour, hourly_means

log = logging.getLogger(__name__)

HISTORY_POINTS = 24 * 7 * 9  # about 9 weeks of hourly observations
MAX_EXTENSION_STEPS = 24 * 7  # extend a short forecast by at most this many steps
# A cached forecast older than this is not reused as a fallback: providers refresh hourly or
# faster, so an older one has been superseded (the [carbon] config's default too).
MAX_FORECAST_AGE_S = 3600.0


class ResilientCarbonSource:
    """Wraps a provider with a cache, a maximum forecast age and a conservative fallback."""

    def __init__(
        self,
        provider: CarbonProvider,
        conservative_intensity_g_per_kwh: float,
        max_forecast_age_s: float = MAX_FORECAST_AGE_S,
        clock: Clock = utc_now,
        *,
        skill: ForecastSkill | None = None,
        blend: bool = True,
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
        self.skill = skill if skill is not None else ForecastSkill()
        self.blend = blend
        # (newest history hour, hours) -> our forecaster's hourly values after that hour.
        self._local_cache: tuple[tuple[datetime, int], np.ndarray, str] | None = None
        self._history_fetched_hour: datetime | None = None

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
        await self._fetch_history(now)
        self._remember(fresh)
        self.last_good = fresh
        return self._with_upper(self._blend_and_extend(fresh, now, horizon_s), now)

    async def aclose(self) -> None:
        """Close the wrapped provider."""
        await self.provider.aclose()

    async def _fetch_history(self, now: datetime) -> None:
        """Once an hour, the provider's observed history since the newest hour known (if it has one)."""
        fetch = getattr(self.provider, "recent_history", None)
        hour = floor_hour(now)
        if fetch is None or self._history_fetched_hour == hour:
            return
        self._history_fetched_hour = hour
        since = max(self.history) if self.history else None
        try:
            points = await fetch(since)
        except CarbonProviderError as exc:
            # The forecast itself worked: without history the blend waits, nothing falls back.
            log.warning("carbon provider history failed: %s", exc)
            return
        self._remember_points(points)

    def _remember(self, forecast: CarbonForecast) -> None:
        self._remember_points(forecast.points)

    def _remember_points(self, points: Sequence[ForecastPoint]) -> None:
        for point in points:
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

    def seed_history(self, samples: list[tuple[datetime, float]]) -> None:
        """Add observed (time, intensity) pairs, e.g. stored before a restart, to the history."""
        for at, value in sorted(samples):
            self.history.setdefault(floor_hour(at), value)
        for hour in sorted(self.history)[:-HISTORY_POINTS]:
            del self.history[hour]

    def _forecast_origin(self) -> str:
        """Where the provider's forecast comes from: "provider", "local" or "exact"."""
        mode = getattr(self.provider, "forecast_mode", None)
        if mode == "oracle":
            return "exact"
        return "local" if mode == "model" else "provider"

    def _speedup(self) -> float:
        """Trace seconds per wall second (replays; 1 for live providers)."""
        return float(getattr(self.provider, "clock_speedup", 1.0))

    def _local_hourly(self, hours: int) -> tuple[np.ndarray, datetime, str] | None:
        """Our forecaster's values for the hours after the newest history hour (cached per hour)."""
        if len(self.history) < 24:
            return None
        newest = max(self.history)
        key = (newest, hours)
        if self._local_cache is None or self._local_cache[0] != key:
            values, method = forecast_hourly(np.asarray(self.history_hourly()), hours)
            self._local_cache = (key, values, method)
        return self._local_cache[1], newest, self._local_cache[2]

    def _blend_and_extend(
        self, fresh: CarbonForecast, now: datetime, horizon_s: int
    ) -> CarbonForecast:
        """The provider's forecast blended with ours by measured skill, extended, and scored."""
        if self._speedup() != 1.0:
            # A compressed replay's hours are not wall hours: no skill is measured on it.
            return self._extend(fresh, now, horizon_s)
        origin = floor_hour(now)
        hours = self.skill.horizon_h
        blended = fresh
        if self.blend and self._forecast_origin() == "provider":
            provider_hourly = hourly_means(fresh, origin, self._covered_until(fresh), hours)
            self.skill.issue("provider", origin, provider_hourly)
            local = self._local_hourly(hours + 1)
            if local is not None:
                values, newest, method = local
                skip = int((origin - newest) / HOUR)  # local values start after `newest`
                local_hourly = values[skip : skip + hours] if skip >= 0 else np.zeros(0)
                self.skill.issue("local", origin, local_hourly)
                blended = self._blend(fresh, origin, provider_hourly, local_hourly, method)
        final = self._extend(blended, now, horizon_s)
        end = now + timedelta(seconds=horizon_s)
        self.skill.issue("final", origin, hourly_means(final, origin, end, hours))
        return final

    @staticmethod
    def _covered_until(forecast: CarbonForecast) -> datetime:
        """Where a forecast stops saying anything: its last point plus one of its steps."""
        points = forecast.points
        step = points[-1].at - points[-2].at if len(points) >= 2 else HOUR
        return points[-1].at + step

    def _blend(
        self,
        fresh: CarbonForecast,
        origin: datetime,
        provider_hourly: np.ndarray,
        local_hourly: np.ndarray,
        method: str,
    ) -> CarbonForecast:
        """Scale each provider point by its hour's blend with ours (log space, skill weights)."""
        weights = self.skill.provider_weights(self.history)
        n = min(len(provider_hourly), len(local_hourly))
        if n == 0 or bool(np.all(weights[:n] >= 1.0)):
            return fresh
        points = []
        for point in fresh.points:
            h = int((point.at - origin) / HOUR)
            if point.kind != PointKind.FORECAST or not 1 <= h <= n:
                points.append(point)
                continue
            w = float(weights[h - 1])
            p, q = provider_hourly[h - 1], local_hourly[h - 1]
            factor = float(np.exp((1 - w) * (np.log(max(q, 1e-9)) - np.log(max(p, 1e-9)))))
            points.append(
                point.model_copy(update={"intensity_g_per_kwh": point.intensity_g_per_kwh * factor})
            )
        shown = ", ".join(f"{h} h {weights[h - 1]:.2f}" for h in (1, 6, 24) if h <= n)
        return fresh.model_copy(
            update={
                "points": tuple(points),
                "source": f"{fresh.source}; blended with local {method} by measured skill "
                f"(provider weight {shown})",
            }
        )

    def _with_upper(self, forecast: CarbonForecast, now: datetime) -> CarbonForecast:
        """The forecast with each forecast point's upper quantile (measured points: the value)."""
        exact = self._forecast_origin() == "exact"
        factors, _ = self.skill.upper_factors(self.history)
        speedup = self._speedup()
        points = []
        for point in forecast.points:
            if point.kind != PointKind.FORECAST or exact:
                points.append(
                    point.model_copy(update={"upper_g_per_kwh": point.intensity_g_per_kwh})
                )
                continue
            ahead_h = (point.at - now).total_seconds() * speedup / 3600.0
            h = min(max(1, int(np.ceil(ahead_h))), len(factors))
            points.append(
                point.model_copy(
                    update={"upper_g_per_kwh": point.intensity_g_per_kwh * float(factors[h - 1])}
                )
            )
        return forecast.model_copy(
            update={"points": tuple(points), "upper_quantile": self.skill.quantile}
        )

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
                windowed = cached.model_copy(update={"points": tuple(points)})
                return self._with_upper(windowed, now).model_copy(
                    update={
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
        flat = CarbonForecast(
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
        return self._with_upper(flat, now)
