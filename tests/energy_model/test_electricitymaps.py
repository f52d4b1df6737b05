"""Electricity Maps v3 client against a local fake server in the documented shape."""

from __future__ import annotations

from datetime import timedelta

import pytest

from energy_model.carbon import (
    PointKind,
    ProviderAuthError,
    ProviderBadResponse,
    ProviderConfigError,
    ProviderRateLimited,
    ProviderRequestError,
    ProviderUnavailable,
    Signal,
)
from energy_model.carbon.base import HttpSettings
from energy_model.carbon.electricitymaps import ElectricityMapsProvider
from tests.energy_model.conftest import FakeClock
from tests.energy_model.fake_http import FakeServer, Reply

LATEST = {
    "zone": "DE",
    "carbonIntensity": 216,
    "datetime": "2024-03-06T19:00:00.000Z",
    "updatedAt": "2024-03-06T18:48:27.926Z",
    "createdAt": "2024-03-03T19:47:16.265Z",
    "emissionFactorType": "lifecycle",
    "isEstimated": True,
    "estimationMethod": "TIME_SLICER_AVERAGE",
}


def forecast_body(values: list[int]) -> dict[str, object]:
    return {
        "zone": "DE",
        "forecast": [
            {"carbonIntensity": v, "datetime": f"2024-03-06T{20 + i:02d}:00:00.000Z"}
            if 20 + i < 24
            else {"carbonIntensity": v, "datetime": f"2024-03-07T{20 + i - 24:02d}:00:00.000Z"}
            for i, v in enumerate(values)
        ],
        "updatedAt": "2024-03-06T18:50:00.000Z",
    }


def history_body() -> dict[str, object]:
    items = []
    for i in range(24):
        hour = (19 + i) % 24
        day = 5 if 19 + i < 24 else 6
        items.append(
            {
                "zone": "DE",
                "carbonIntensity": 400 + 10 * (i % 5),
                "datetime": f"2024-03-0{day}T{hour:02d}:00:00.000Z",
                "updatedAt": "2024-03-06T18:48:27.926Z",
                "createdAt": "2024-03-03T19:47:16.265Z",
                "emissionFactorType": "lifecycle",
                "isEstimated": False,
                "estimationMethod": None,
            }
        )
    return {"zone": "DE", "history": items}


def provider(server: FakeServer, clock: FakeClock, http: HttpSettings) -> ElectricityMapsProvider:
    return ElectricityMapsProvider("DE", "secret", server.base_url, settings=http, clock=clock)


async def test_latest_and_forecast(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/carbon-intensity/latest", Reply(body=LATEST))
    fake_server.route("/carbon-intensity/forecast", Reply(body=forecast_body([326, 300, 280, 270])))
    p = provider(fake_server, clock, fast_http)
    forecast = await p.get_forecast(3 * 3600)
    await p.aclose()
    assert forecast.signal == Signal.AVERAGE_LCA
    assert forecast.points[0].at == clock.now
    assert forecast.points[0].intensity_g_per_kwh == 216
    assert forecast.points[0].kind == PointKind.ESTIMATED  # isEstimated: true
    assert [p.intensity_g_per_kwh for p in forecast.points[1:]] == [326, 300, 280]
    assert all(p.kind == PointKind.FORECAST for p in forecast.points[1:])
    assert forecast.points[-1].at < clock.now + timedelta(hours=3)
    seen = fake_server.requests[0]
    assert seen.headers.get("auth-token") == "secret"
    assert seen.query == {"zone": ["DE"], "emissionFactorType": ["lifecycle"]}


async def test_no_forecast_access_falls_back_to_history(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/carbon-intensity/latest", Reply(body=LATEST))
    fake_server.route(
        "/carbon-intensity/forecast",
        Reply(
            401, {"status": "error", "message": "Path /v3/carbon-intensity/forecast not in plan"}
        ),
    )
    fake_server.route("/carbon-intensity/history", Reply(body=history_body()))
    p = provider(fake_server, clock, fast_http)
    forecast = await p.get_forecast(6 * 3600)
    await p.aclose()
    assert "no forecast access" in forecast.source
    assert len(forecast.points) == 7  # now (19:10) + 20:00 .. 01:00
    # Seasonal naive: the hour after the latest repeats the value 24 h earlier.
    assert forecast.points[1].intensity_g_per_kwh == history_body()["history"][1]["carbonIntensity"]  # type: ignore[index]


async def test_bad_zone_is_a_request_error(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/carbon-intensity/latest",
        Reply(400, {"status": "error", "message": "Zone 'XX' does not exist."}),
    )
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(ProviderRequestError, match="does not exist"):
        await p.get_forecast(3600)
    await p.aclose()
    assert fake_server.hits["/carbon-intensity/latest"] == 1  # 4xx is not retried


async def test_bad_token(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/carbon-intensity/latest", Reply(401, {"status": "error", "message": "Invalid token"})
    )
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(ProviderAuthError, match="Invalid token") as info:
        await p.get_forecast(3600)
    await p.aclose()
    assert info.value.status_code == 401


async def test_rate_limit_then_success(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/carbon-intensity/latest",
        Reply(429, {"message": "Too many requests"}, headers={"Retry-After": "0"}),
        Reply(body=LATEST),
    )
    fake_server.route("/carbon-intensity/forecast", Reply(body=forecast_body([300])))
    p = provider(fake_server, clock, fast_http)
    forecast = await p.get_forecast(3600)
    await p.aclose()
    assert forecast.now_g_per_kwh == 216
    assert fake_server.hits["/carbon-intensity/latest"] == 2


async def test_rate_limit_exhausted(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/carbon-intensity/latest",
        Reply(429, {"message": "Too many requests"}, headers={"Retry-After": "0.01"}),
    )
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(ProviderRateLimited) as info:
        await p.get_forecast(3600)
    await p.aclose()
    assert info.value.retry_after_s == pytest.approx(0.01)
    assert fake_server.hits["/carbon-intensity/latest"] == fast_http.attempts


async def test_timeout_is_unavailable(fake_server: FakeServer, clock: FakeClock) -> None:
    fake_server.route("/carbon-intensity/latest", Reply(body=LATEST, delay_s=0.5))
    http = HttpSettings(timeout_s=0.1, attempts=2, backoff_initial_s=0.01, backoff_max_s=0.01)
    p = provider(fake_server, clock, http)
    with pytest.raises(ProviderUnavailable, match="timed out"):
        await p.get_forecast(3600)
    await p.aclose()
    assert fake_server.wait_for_hits("/carbon-intensity/latest", 2) == 2


async def test_server_error_retried(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/carbon-intensity/latest",
        Reply(502, "<html><body><h1>502 Bad Gateway</h1></body></html>", "text/html"),
        Reply(body=LATEST),
    )
    fake_server.route("/carbon-intensity/forecast", Reply(body=forecast_body([300])))
    p = provider(fake_server, clock, fast_http)
    forecast = await p.get_forecast(3600)
    await p.aclose()
    assert forecast.now_g_per_kwh == 216


async def test_connection_refused(clock: FakeClock, fast_http: HttpSettings) -> None:
    p = ElectricityMapsProvider("DE", "k", "http://127.0.0.1:9", settings=fast_http, clock=clock)
    with pytest.raises(ProviderUnavailable, match="failed"):
        await p.get_forecast(3600)
    await p.aclose()


def test_requires_token() -> None:
    with pytest.raises(ProviderConfigError, match="token"):
        ElectricityMapsProvider("DE", None)


async def test_html_200_is_a_bad_response(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/carbon-intensity/latest",
        Reply(200, "<html><body>Login to Wi-Fi</body></html>", "text/html"),
    )
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(ProviderBadResponse, match="expected JSON, got text/html"):
        await p.get_forecast(3600)
    await p.aclose()


async def test_missing_fields_is_a_bad_response(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/carbon-intensity/latest", Reply(body=LATEST))
    fake_server.route("/carbon-intensity/forecast", Reply(body={"zone": "DE", "data": []}))
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(ProviderBadResponse, match="unexpected response shape"):
        await p.get_forecast(3600)
    await p.aclose()
