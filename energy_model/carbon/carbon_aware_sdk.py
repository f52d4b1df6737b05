"""Green Software Foundation Carbon Aware SDK WebAPI client (values already in g CO2/kWh)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from energy_model.carbon.base import Clock, HttpProvider, HttpSettings, parse_utc, utc_now
from energy_model.carbon.errors import (
    ProviderConfigError,
    ProviderNoData,
    ProviderRequestError,
)
from energy_model.carbon.forecast import (
    CarbonForecast,
    ForecastPoint,
    PointKind,
    Signal,
    window_points,
)

DEFAULT_BASE_URL = "http://localhost:8080"  # the SDK is self-hosted; there is no public instance


class CarbonAwareSdkProvider(HttpProvider):
    """Current emissions and forecast for a cloud location (e.g. 'eastus') from a CASDK WebAPI."""

    name = "carbon-aware-sdk"

    def __init__(
        self,
        region: str,
        base_url: str | None = None,
        api_key: str | None = None,
        settings: HttpSettings | None = None,
        clock: Clock = utc_now,
        signal: Signal = Signal.AVERAGE,
    ) -> None:
        if not region:
            raise ProviderConfigError(self.name, "a location is required, e.g. region = 'eastus'")
        # Deployments fronted by an API gateway usually want a key header; plain ones need none.
        headers = {"Ocp-Apim-Subscription-Key": api_key} if api_key else None
        # The SDK does not say which signal its source emits: WattTime-backed ones are marginal.
        self.signal = signal
        super().__init__(base_url or DEFAULT_BASE_URL, region, settings, headers, clock)

    async def current(self) -> ForecastPoint:
        """GET /emissions/bylocation for the last hour; the latest rating (204 = no data)."""
        now = self.clock()
        what = f"emissions by location for {self.region}"
        params = {
            "location": self.region,
            "time": (now - timedelta(hours=1)).isoformat(),
            "toTime": now.isoformat(),
        }
        body = self.json_body(await self.get("/emissions/bylocation", params), what)
        try:
            items = sorted(body, key=lambda item: parse_utc(item["time"]))
            if not items:
                raise ProviderNoData(self.name, f"{what}: empty list")
            last = items[-1]
            return ForecastPoint(
                at=parse_utc(last["time"]),
                intensity_g_per_kwh=float(last["rating"]),
                kind=PointKind.MEASURED,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc

    async def forecast(self) -> list[ForecastPoint]:
        """GET /emissions/forecasts/current: the forecastData of this location."""
        what = f"current forecast for {self.region}"
        response = await self.get("/emissions/forecasts/current", {"location": self.region})
        if response.status_code == 501:
            raise ProviderNoData(
                self.name, f"{what}: the SDK's data source has no forecast", response.status_code
            )
        body = self.json_body(response, what)
        try:
            entries: list[dict[str, Any]] = body if isinstance(body, list) else [body]
            for entry in entries:
                if str(entry.get("location", self.region)).lower() == self.region.lower():
                    return [
                        ForecastPoint(
                            at=parse_utc(item["timestamp"]),
                            intensity_g_per_kwh=float(item["value"]),
                            kind=PointKind.FORECAST,
                        )
                        for item in entry["forecastData"]
                    ]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc
        raise ProviderNoData(self.name, f"{what}: no entry for this location")

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        """Measured rating now when available, then the SDK's forecast."""
        now = self.clock()
        future = await self.forecast()
        try:
            current: ForecastPoint | None = await self.current()
        except (ProviderNoData, ProviderRequestError):
            current = None  # the forecast's first point then stands for now
        points = future if current is None else [current, *(p for p in future if p.at > current.at)]
        if not points:
            raise ProviderNoData(self.name, f"empty forecast for {self.region}")
        return CarbonForecast(
            region=self.region,
            source=self.name,
            signal=self.signal,
            fetched_at=now,
            points=window_points(points, now, horizon_s),
        )
