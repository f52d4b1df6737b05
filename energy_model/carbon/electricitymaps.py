"""Electricity Maps API v3 client (`auth-token` header; g CO2e/kWh, lifecycle by default)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import numpy as np

from energy_model.carbon.base import Clock, HttpProvider, HttpSettings, parse_utc, utc_now
from energy_model.carbon.errors import (
    ProviderAuthError,
    ProviderConfigError,
    ProviderNoData,
)
from energy_model.carbon.forecast import (
    CarbonForecast,
    ForecastPoint,
    PointKind,
    Signal,
    window_points,
)
from energy_model.carbon.forecaster import forecast_hourly

DEFAULT_BASE_URL = "https://api.electricitymaps.com/v3"


class ElectricityMapsProvider(HttpProvider):
    """Latest + forecast for a zone; falls back to history + local forecaster without forecast access."""

    name = "electricitymaps"

    def __init__(
        self,
        region: str,
        api_key: str | None,
        base_url: str | None = None,
        emission_factor: str = "lifecycle",
        settings: HttpSettings | None = None,
        clock: Clock = utc_now,
    ) -> None:
        if not api_key:
            raise ProviderConfigError(
                self.name,
                "an API token is required (set the env var named by [carbon] api_key_env)",
            )
        if not region:
            raise ProviderConfigError(self.name, "a zone is required, e.g. region = 'DE'")
        if emission_factor not in ("lifecycle", "direct"):
            raise ProviderConfigError(
                self.name, f"emission_factor must be lifecycle or direct, got {emission_factor!r}"
            )
        super().__init__(
            base_url or DEFAULT_BASE_URL, region, settings, {"auth-token": api_key}, clock
        )
        self.emission_factor = emission_factor
        self.signal = (
            Signal.AVERAGE_LCA if emission_factor == "lifecycle" else Signal.AVERAGE_DIRECT
        )

    def _params(self) -> dict[str, str]:
        return {"zone": self.region, "emissionFactorType": self.emission_factor}

    @staticmethod
    def _point(item: dict[str, Any], kind: PointKind | None = None) -> ForecastPoint:
        if kind is None:
            kind = PointKind.ESTIMATED if item.get("isEstimated") else PointKind.MEASURED
        return ForecastPoint(
            at=parse_utc(item["datetime"]),
            intensity_g_per_kwh=float(item["carbonIntensity"]),
            kind=kind,
        )

    async def latest(self) -> ForecastPoint:
        """GET /carbon-intensity/latest."""
        what = f"latest intensity for zone {self.region}"
        body = self.json_body(await self.get("/carbon-intensity/latest", self._params()), what)
        try:
            if body.get("carbonIntensity") is None:
                raise ProviderNoData(self.name, f"{what}: carbonIntensity is null")
            return self._point(body)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc

    async def history(self) -> list[ForecastPoint]:
        """GET /carbon-intensity/history (last 24 h, hourly)."""
        what = f"24 h history for zone {self.region}"
        body = self.json_body(await self.get("/carbon-intensity/history", self._params()), what)
        try:
            return [
                self._point(item)
                for item in body["history"]
                if item.get("carbonIntensity") is not None
            ]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc

    async def recent_history(self, since: datetime | None) -> list[ForecastPoint]:
        """The last 24 h observed (the API serves no other window): our forecaster's history."""
        return [p for p in await self.history() if since is None or p.at > since]

    async def forecast(self) -> list[ForecastPoint]:
        """GET /carbon-intensity/forecast."""
        what = f"forecast for zone {self.region}"
        body = self.json_body(await self.get("/carbon-intensity/forecast", self._params()), what)
        try:
            return [
                self._point(item, PointKind.FORECAST)
                for item in body["forecast"]
                if item.get("carbonIntensity") is not None
            ]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        """Latest value now, then the API forecast (or a local forecast from the 24 h history)."""
        now = self.clock()
        current = await self.latest()
        source = self.name
        try:
            future = await self.forecast()
        except (ProviderAuthError, ProviderNoData) as exc:
            # Plans without forecast access: forecast locally from the last 24 h.
            future = await self._local_forecast(current, horizon_s)
            source = f"{self.name} (no forecast access: {exc.status_code}; local forecast from 24 h history)"
        points = [p for p in future if p.at > current.at]
        return CarbonForecast(
            region=self.region,
            source=source,
            signal=self.signal,
            fetched_at=now,
            points=window_points([current, *points], now, horizon_s),
        )

    async def _local_forecast(self, current: ForecastPoint, horizon_s: int) -> list[ForecastPoint]:
        past = await self.history()
        values = [p.intensity_g_per_kwh for p in sorted(past, key=lambda p: p.at)]
        if not values or past[-1].at < current.at:
            values.append(current.intensity_g_per_kwh)
        horizon_h = max(1, -(-horizon_s // 3600))
        future, _ = forecast_hourly(np.asarray(values), horizon_h)
        return [
            ForecastPoint(
                at=current.at + timedelta(hours=h),
                intensity_g_per_kwh=float(v),
                kind=PointKind.FORECAST,
            )
            for h, v in enumerate(future, start=1)
        ]
