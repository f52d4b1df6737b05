"""The one forecast type every carbon provider returns."""

from __future__ import annotations

import itertools
from bisect import bisect_right
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from energy_model.carbon.series import IntensitySeries


class PointKind(StrEnum):
    """How a point's value was obtained."""

    MEASURED = "measured"
    ESTIMATED = "estimated"
    FORECAST = "forecast"


class Signal(StrEnum):
    """Which intensity signal a forecast carries; average and marginal must not be mixed."""

    AVERAGE_LCA = "average_lca"  # life-cycle average (Electricity Maps default, traces)
    AVERAGE_DIRECT = "average_direct"  # direct-combustion average
    AVERAGE = "average"  # average, method unspecified by the source (UK NESO, CASDK)
    MARGINAL_MOER = "marginal_moer"  # WattTime marginal operating emissions rate


class ForecastPoint(BaseModel):
    """Intensity from `at` until the next point (g CO2e/kWh)."""

    model_config = ConfigDict(frozen=True)

    at: AwareDatetime
    intensity_g_per_kwh: float = Field(ge=0)
    kind: PointKind
    # The forecast's upper quantile (CarbonForecast.upper_quantile) from its measured error;
    # None where not known (then the value itself stands in).
    upper_g_per_kwh: float | None = Field(default=None, ge=0)

    @field_validator("at")
    @classmethod
    def _to_utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)


class CarbonForecast(BaseModel):
    """Current intensity (first point = now) and the forecast over a horizon for one region."""

    model_config = ConfigDict(frozen=True)

    region: str
    source: str
    signal: Signal
    fetched_at: AwareDatetime
    points: tuple[ForecastPoint, ...]
    degraded: bool = False
    degraded_reason: str | None = None
    # Which quantile of the intensity the points' upper_g_per_kwh are (None: no upper values).
    upper_quantile: float | None = None

    @field_validator("points")
    @classmethod
    def _increasing(cls, points: tuple[ForecastPoint, ...]) -> tuple[ForecastPoint, ...]:
        if not points:
            raise ValueError("a forecast needs at least one point")
        for a, b in itertools.pairwise(points):
            if b.at <= a.at:
                raise ValueError(f"points must be strictly increasing in time ({a.at} >= {b.at})")
        return points

    @property
    def times(self) -> tuple[datetime, ...]:
        """Start time of every point (UTC)."""
        return tuple(p.at for p in self.points)

    @property
    def intensity_g_per_kwh(self) -> tuple[float, ...]:
        """Intensity of every point (g CO2e/kWh)."""
        return tuple(p.intensity_g_per_kwh for p in self.points)

    @property
    def upper_g_per_kwh(self) -> tuple[float, ...]:
        """Upper quantile of every point (the point's value where none is known)."""
        return tuple(
            p.intensity_g_per_kwh if p.upper_g_per_kwh is None else p.upper_g_per_kwh
            for p in self.points
        )

    def upper_series(self) -> IntensitySeries:
        """The upper quantile as a step series: what a hard budget plans with."""
        return IntensitySeries(
            self.times, self.upper_g_per_kwh, source=f"{self.source} (upper q{self.upper_quantile})"
        )

    @property
    def now_g_per_kwh(self) -> float:
        """Intensity of the first point (now)."""
        return self.points[0].intensity_g_per_kwh

    def intensity_at(self, at: datetime) -> float:
        """Intensity holding at `at` (the last point is taken to hold after the end)."""
        i = bisect_right(self.times, at) - 1
        if i < 0:
            raise ValueError(
                f"{at.isoformat()} is before the forecast starts ({self.points[0].at})"
            )
        return self.points[i].intensity_g_per_kwh

    def end_at(self) -> datetime:
        """Start of the last point (the forecast says nothing new after it)."""
        return self.points[-1].at

    def to_series(self) -> IntensitySeries:
        """The points as an IntensitySeries."""
        return IntensitySeries(self.times, self.intensity_g_per_kwh, source=self.source)

    def as_degraded(self, reason: str) -> CarbonForecast:
        """A copy marked degraded with a reason the service can show."""
        return self.model_copy(update={"degraded": True, "degraded_reason": reason})

    def from_now(self, now: datetime, horizon_s: int) -> CarbonForecast:
        """The part covering [now, now + horizon_s], the first point moved to `now`."""
        return self.model_copy(update={"points": window_points(self.points, now, horizon_s)})


def window_points(
    points: tuple[ForecastPoint, ...] | list[ForecastPoint], now: datetime, horizon_s: int
) -> tuple[ForecastPoint, ...]:
    """Points covering [now, now + horizon_s]: the one holding at `now` is re-stamped to `now`."""
    ordered = sorted(points, key=lambda p: p.at)
    end = now + timedelta(seconds=horizon_s)
    times = [p.at for p in ordered]
    i = bisect_right(times, now) - 1
    if i < 0:
        # Nothing known before now: the earliest point stands in for the present.
        i = 0
    first = ordered[i].model_copy(update={"at": now})
    rest = [p for p in ordered[i + 1 :] if now < p.at < end]
    return (first, *rest)
