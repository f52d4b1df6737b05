"""UK Carbon Intensity API client (NESO; no key; 30-minute periods, g CO2/kWh)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from energy_model.carbon.base import Clock, HttpProvider, HttpSettings, parse_utc, utc_now
from energy_model.carbon.errors import ProviderConfigError, ProviderNoData
from energy_model.carbon.forecast import (
    CarbonForecast,
    ForecastPoint,
    PointKind,
    Signal,
    window_points,
)

DEFAULT_BASE_URL = "https://api.carbonintensity.org.uk"
NATIONAL = "national"


class UkCarbonIntensityProvider(HttpProvider):
    """National (`region='national'`) or regional (`region='regionid:13'` or '13') forecasts."""

    name = "uk"

    def __init__(
        self,
        region: str = NATIONAL,
        base_url: str | None = None,
        settings: HttpSettings | None = None,
        clock: Clock = utc_now,
    ) -> None:
        region = (region or NATIONAL).strip().lower()
        self.region_id: int | None = None
        if region != NATIONAL:
            raw = region.removeprefix("regionid:")
            if not raw.isdigit() or not 1 <= int(raw) <= 17:
                raise ProviderConfigError(
                    self.name,
                    f"region must be 'national' or a region id 1..17 (e.g. 'regionid:13'), "
                    f"got {region!r}",
                )
            self.region_id = int(raw)
        super().__init__(base_url or DEFAULT_BASE_URL, region, settings, None, clock)

    @staticmethod
    def _fmt(at: datetime) -> str:
        """The API's URL time format, YYYY-MM-DDThh:mmZ (UTC)."""
        return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%MZ")

    def _period_points(self, periods: list[dict[str, Any]]) -> list[ForecastPoint]:
        points = []
        for period in periods:
            intensity = period["intensity"]
            actual = intensity.get("actual")
            value = actual if actual is not None else intensity.get("forecast")
            if value is None:
                continue
            points.append(
                ForecastPoint(
                    at=parse_utc(period["from"]),
                    intensity_g_per_kwh=float(value),
                    kind=PointKind.MEASURED if actual is not None else PointKind.FORECAST,
                )
            )
        return points

    async def national(self, from_at: datetime, hours: int = 48) -> list[ForecastPoint]:
        """GET /intensity/{from}/fw24h or fw48h: 30-minute periods from `from_at`."""
        window = "fw24h" if hours <= 24 else "fw48h"
        what = f"national intensity {window}"
        body = self.json_body(await self.get(f"/intensity/{self._fmt(from_at)}/{window}"), what)
        try:
            return self._period_points(body["data"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc

    async def recent_history(self, since: datetime | None) -> list[ForecastPoint]:
        """GET /intensity/{now}/pt24h: the national half hours of the last 24 h with an actual.

        Regional data is forecast only, so a regional source has no observed history.
        """
        if self.region_id is not None:
            return []
        what = "national intensity pt24h"
        now = self.clock()
        body = self.json_body(await self.get(f"/intensity/{self._fmt(now)}/pt24h"), what)
        try:
            points = self._period_points(body["data"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc
        return [
            p for p in points if p.kind == PointKind.MEASURED and (since is None or p.at > since)
        ]

    async def current_national(self) -> ForecastPoint:
        """GET /intensity: the current half hour."""
        what = "current national intensity"
        body = self.json_body(await self.get("/intensity"), what)
        try:
            points = self._period_points(body["data"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc
        if not points:
            raise ProviderNoData(self.name, f"{what}: no value for the current period")
        return points[0]

    async def regional(self, from_at: datetime) -> list[ForecastPoint]:
        """GET /regional/intensity/{from}/fw48h/regionid/{id} (forecast only)."""
        path = f"/regional/intensity/{self._fmt(from_at)}/fw48h/regionid/{self.region_id}"
        what = f"regional intensity fw48h for region {self.region_id}"
        body = self.json_body(await self.get(path), what)
        try:
            data = body["data"]
            # /regionid/{id} nests periods inside the region object; other routes the reverse.
            if isinstance(data, dict):
                data = [data]
            periods: list[dict[str, Any]] = []
            for entry in data:
                if "data" in entry:
                    periods.extend(entry["data"])
                elif "regions" in entry:
                    for region in entry["regions"]:
                        if int(region["regionid"]) == self.region_id:
                            periods.append(
                                {"from": entry["from"], "intensity": region["intensity"]}
                            )
                else:
                    periods.append(entry)
            return self._period_points(periods)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        """The 30-minute forecast from the current period onwards (first point = now)."""
        now = self.clock()
        hours = max(1, -(-horizon_s // 3600))
        # Slots are (from, to]: ask from just before now so the current period is included.
        from_at = now - timedelta(minutes=30)
        if self.region_id is None:
            points = await self.national(from_at, hours)
        else:
            points = await self.regional(from_at)
        if not points:
            raise ProviderNoData(self.name, f"no periods returned for {self.region}")
        return CarbonForecast(
            region=self.region,
            source=self.name,
            signal=Signal.AVERAGE,
            fetched_at=now,
            points=window_points(points, now, horizon_s),
        )
