"""WattTime v3 client against a local fake server in the documented shape."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest

from energy_model.carbon import (
    PointKind,
    ProviderAuthError,
    ProviderConfigError,
    ProviderRequestError,
    Signal,
)
from energy_model.carbon.base import HttpSettings
from energy_model.carbon.watttime import WattTimeProvider, lbs_per_mwh_to_g_per_kwh
from tests.energy_model.conftest import FakeClock
from tests.energy_model.fake_http import FakeServer, Reply, Seen

META = {
    "data_point_period_seconds": 300,
    "region": "CAISO_NORTH",
    "warnings": [],
    "signal_type": "co2_moer",
    "model": {"date": "2023-03-01"},
    "units": "lbs_co2_per_mwh",
    "generated_at_period_seconds": 300,
    "generated_at": "2024-03-06T19:10:00+00:00",
}


def forecast_body() -> dict[str, object]:
    data = [
        {"point_time": f"2024-03-06T{19 + m // 60:02d}:{m % 60:02d}:00+00:00", "value": 1000.0 + m}
        for m in range(10, 130, 5)
    ]
    return {"data": data, "meta": META}


def login_ok(token: str) -> Reply:
    return Reply(body={"token": token})


def bearer(seen: Seen) -> str:
    return seen.headers.get("Authorization", "")


def provider(server: FakeServer, clock: FakeClock, http: HttpSettings) -> WattTimeProvider:
    return WattTimeProvider(
        "CAISO_NORTH", "alice", "pw", server.base_url, settings=http, clock=clock
    )


def test_unit_conversion() -> None:
    # 1000 lbs/MWh = 453.59237 g/kWh (CASDK ConvertMoerToGramsPerKilowattHour).
    assert lbs_per_mwh_to_g_per_kwh(1000.0) == pytest.approx(453.59237)


async def test_login_then_forecast(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/login", login_ok("tok-1"))
    fake_server.route(
        "/v3/forecast",
        lambda seen: Reply(body=forecast_body()) if bearer(seen) == "Bearer tok-1" else Reply(401),
    )
    p = provider(fake_server, clock, fast_http)
    forecast = await p.get_forecast(3600)
    await p.aclose()
    login = fake_server.requests[0]
    assert login.path == "/login"
    assert login.headers["Authorization"] == "Basic " + base64.b64encode(b"alice:pw").decode()
    assert forecast.signal == Signal.MARGINAL_MOER
    assert "lbs/MWh" in forecast.source
    assert forecast.points[0].at == clock.now
    assert forecast.points[0].intensity_g_per_kwh == pytest.approx(1010.0 * 0.45359237)
    assert all(p.kind == PointKind.FORECAST for p in forecast.points)
    assert len(forecast.points) == 12  # 19:10 .. 20:05 in 5-minute steps
    query = fake_server.requests[1].query
    assert query["signal_type"] == ["co2_moer"] and query["region"] == ["CAISO_NORTH"]


async def test_token_reused_then_relogin_on_403(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/login", login_ok("tok-1"), login_ok("tok-2"))
    state = {"valid": "Bearer tok-1"}
    fake_server.route(
        "/v3/forecast",
        lambda seen: (
            Reply(body=forecast_body())
            if bearer(seen) == state["valid"]
            else Reply(403, {"error": "Invalid query parameters", "message": "Invalid scope."})
        ),
    )
    p = provider(fake_server, clock, fast_http)
    await p.get_forecast(3600)
    await p.get_forecast(3600)
    assert fake_server.hits["/login"] == 1  # token cached
    state["valid"] = "Bearer tok-2"  # server revoked tok-1
    await p.get_forecast(3600)
    await p.aclose()
    assert fake_server.hits["/login"] == 2


async def test_token_expiry_triggers_login(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/login", login_ok("tok-1"))
    fake_server.route("/v3/forecast", Reply(body=forecast_body()))
    p = provider(fake_server, clock, fast_http)
    await p.get_forecast(3600)
    clock.advance(31 * 60)
    await p.get_forecast(3600)
    await p.aclose()
    assert fake_server.hits["/login"] == 2


async def test_bad_login_html_403(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/login",
        Reply(
            403,
            "<html><head><title>403 Forbidden</title></head><body><center><h1>403 Forbidden"
            "</h1></center><hr><center>nginx</center></body></html>",
            "text/html",
        ),
    )
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(ProviderAuthError, match="403 Forbidden") as info:
        await p.get_forecast(3600)
    await p.aclose()
    assert info.value.status_code == 403


async def test_scope_error_after_relogin(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/login", login_ok("tok"))
    fake_server.route(
        "/v3/forecast",
        Reply(403, {"error": "Invalid query parameters", "message": "Invalid scope. Subscribe."}),
    )
    p = WattTimeProvider(
        "PSCO", "alice", "pw", fake_server.base_url, settings=fast_http, clock=clock
    )
    with pytest.raises(ProviderAuthError, match="Invalid scope"):
        await p.get_forecast(3600)
    await p.aclose()
    assert fake_server.hits["/login"] == 2  # logged in again once, then gave up


async def test_historical_and_signal_index(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/login", login_ok("tok"))
    fake_server.route(
        "/v3/historical",
        Reply(
            body={
                "data": [
                    {"point_time": "2024-03-06T18:00:00+00:00", "value": 900.0},
                    {
                        "point_time": "2024-03-06T18:05:00+00:00",
                        "value": 950.0,
                        "imputed_data_used": True,
                    },
                ],
                "meta": {**META, "model": {"type": "binned_regression"}},
            }
        ),
    )
    fake_server.route(
        "/v3/signal-index",
        Reply(
            body={
                "data": [{"point_time": "2024-06-18T18:40:00+00:00", "value": 96.0}],
                "meta": {**META, "units": "percentile"},
            }
        ),
    )
    p = provider(fake_server, clock, fast_http)
    start = datetime(2024, 3, 6, 18, tzinfo=UTC)
    points = await p.historical(start, clock.now)
    assert [pt.kind for pt in points] == [PointKind.MEASURED, PointKind.ESTIMATED]
    assert points[1].intensity_g_per_kwh == pytest.approx(950 * 0.45359237)
    hist_query = fake_server.requests[-1].query
    assert hist_query["start"] == ["2024-03-06T18:00:00+00:00"]  # carries a timezone
    assert await p.signal_index() == 96.0
    await p.aclose()


async def test_unexpected_units_rejected(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/login", login_ok("tok"))
    body = forecast_body()
    body["meta"] = {**META, "units": "percentile"}
    fake_server.route("/v3/forecast", Reply(body=body))
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(Exception, match="unexpected units"):
        await p.get_forecast(3600)
    await p.aclose()


async def test_bad_region_400(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/login", login_ok("tok"))
    fake_server.route("/v3/forecast", Reply(400, {"error": "Unknown region", "message": "XX"}))
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(ProviderRequestError, match="Unknown region"):
        await p.get_forecast(3600)
    await p.aclose()


def test_requires_credentials() -> None:
    with pytest.raises(ProviderConfigError, match="username and password"):
        WattTimeProvider("CAISO_NORTH", "alice", None)
