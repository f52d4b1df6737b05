"""WattTime API v3 client: marginal MOER (lbs CO2/MWh) converted to g CO2/kWh, labelled marginal."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import httpx

from energy_model.carbon.base import Clock, HttpProvider, HttpSettings, parse_utc, utc_now
from energy_model.carbon.errors import ProviderBadResponse, ProviderConfigError, ProviderNoData
from energy_model.carbon.forecast import (
    CarbonForecast,
    ForecastPoint,
    PointKind,
    Signal,
    window_points,
)

DEFAULT_BASE_URL = "https://api.watttime.org"
# 1 lb = 453.59237 g and 1 MWh = 1000 kWh, so lbs/MWh * 0.45359237 = g/kWh.
G_PER_KWH_PER_LBS_PER_MWH = 453.59237 / 1000.0
TOKEN_LIFETIME_S = 25 * 60  # WattTime tokens last ~30 min; renew a little early
SIGNAL_TYPE = "co2_moer"


def lbs_per_mwh_to_g_per_kwh(value_lbs_per_mwh: float) -> float:
    """Convert a MOER in lbs CO2/MWh to g CO2/kWh."""
    return value_lbs_per_mwh * G_PER_KWH_PER_LBS_PER_MWH


class WattTimeProvider(HttpProvider):
    """Forecast and history of the marginal signal for a WattTime region (e.g. CAISO_NORTH)."""

    name = "watttime"

    def __init__(
        self,
        region: str,
        username: str | None,
        password: str | None,
        base_url: str | None = None,
        settings: HttpSettings | None = None,
        clock: Clock = utc_now,
    ) -> None:
        if not username or not password:
            raise ProviderConfigError(
                self.name,
                "username and password are required (api_key as 'user:password' in the env var "
                "named by [carbon] api_key_env)",
            )
        if not region:
            raise ProviderConfigError(
                self.name, "a region is required, e.g. region = 'CAISO_NORTH'"
            )
        super().__init__(base_url or DEFAULT_BASE_URL, region, settings, None, clock)
        self._basic = (username, password)
        self._token: str | None = None
        self._token_at: datetime | None = None

    async def login(self) -> str:
        """GET /login with HTTP Basic auth; returns and caches the bearer token."""
        response = await self.get("/login", auth=httpx.BasicAuth(*self._basic))
        body = self.json_body(response, "login")
        token = body.get("token") if isinstance(body, dict) else None
        if not token:
            raise ProviderBadResponse(self.name, f"login: no token in response {body!r:.160}")
        self._token, self._token_at = str(token), self.clock()
        return self._token

    async def _authorised_json(self, path: str, params: dict[str, Any], what: str) -> Any:
        fresh = (
            self._token is not None
            and self._token_at is not None
            and (self.clock() - self._token_at).total_seconds() < TOKEN_LIFETIME_S
        )
        token = self._token if fresh and self._token else await self.login()
        response = await self.get(path, params, headers={"Authorization": f"Bearer {token}"})
        if response.status_code in (401, 403):
            # Expired or revoked token: log in again once, as the reference clients do.
            token = await self.login()
            response = await self.get(path, params, headers={"Authorization": f"Bearer {token}"})
        return self.json_body(response, what)

    def _points(self, body: Any, what: str, kind: PointKind) -> list[ForecastPoint]:
        try:
            units = body.get("meta", {}).get("units", "lbs_co2_per_mwh")
            if units != "lbs_co2_per_mwh":
                raise ProviderBadResponse(self.name, f"{what}: unexpected units {units!r}")
            return [
                ForecastPoint(
                    at=parse_utc(item["point_time"]),
                    intensity_g_per_kwh=lbs_per_mwh_to_g_per_kwh(float(item["value"])),
                    kind=kind,
                )
                for item in body["data"]
            ]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.bad_shape(what, exc) from exc

    async def forecast(self, horizon_h: int = 24) -> list[ForecastPoint]:
        """GET /v3/forecast (first point is now), values in g/kWh."""
        what = f"MOER forecast for {self.region}"
        params = {
            "region": self.region,
            "signal_type": SIGNAL_TYPE,
            "horizon_hours": min(max(horizon_h, 0), 72),
        }
        return self._points(
            await self._authorised_json("/v3/forecast", params, what), what, PointKind.FORECAST
        )

    async def historical(self, start_at: datetime, end_at: datetime) -> list[ForecastPoint]:
        """GET /v3/historical between two aware times, values in g/kWh."""
        what = f"MOER history for {self.region}"
        params = {
            "region": self.region,
            "signal_type": SIGNAL_TYPE,
            "start": start_at.isoformat(),
            "end": end_at.isoformat(),
        }
        body = await self._authorised_json("/v3/historical", params, what)
        points = self._points(body, what, PointKind.MEASURED)
        imputed = {
            parse_utc(item["point_time"]) for item in body["data"] if item.get("imputed_data_used")
        }
        return [
            p.model_copy(update={"kind": PointKind.ESTIMATED}) if p.at in imputed else p
            for p in points
        ]

    async def recent_history(self, since: datetime | None) -> list[ForecastPoint]:
        """The MOER observed since `since` (at most the last 24 h): our forecaster's history."""
        now = self.clock()
        start = now - timedelta(hours=24)
        if since is not None and since > start:
            start = since
        return await self.historical(start, now)

    async def signal_index(self) -> float:
        """GET /v3/signal-index: percentile 0 (clean) .. 100 (dirty) against the next 24 h."""
        what = f"signal index for {self.region}"
        params = {"region": self.region, "signal_type": SIGNAL_TYPE}
        body = await self._authorised_json("/v3/signal-index", params, what)
        try:
            return float(body["data"][0]["value"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise self.bad_shape(what, exc) from exc

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        """The MOER forecast (first point = now), marked as the marginal signal."""
        now = self.clock()
        horizon_h = min(72, max(1, -(-horizon_s // 3600)))
        points = await self.forecast(horizon_h)
        if not points:
            raise ProviderNoData(self.name, f"empty MOER forecast for {self.region}")
        return CarbonForecast(
            region=self.region,
            source=f"{self.name} (MOER, converted from lbs/MWh)",
            signal=Signal.MARGINAL_MOER,
            fetched_at=now,
            points=window_points(points, now, horizon_s),
        )
