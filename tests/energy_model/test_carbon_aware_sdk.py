"""Carbon Aware SDK WebAPI client against a local fake server in the documented shape."""

from __future__ import annotations

import pytest

from energy_model.carbon import PointKind, ProviderNoData, ProviderRequestError
from energy_model.carbon.base import HttpSettings
from energy_model.carbon.carbon_aware_sdk import CarbonAwareSdkProvider
from tests.energy_model.conftest import FakeClock
from tests.energy_model.fake_http import FakeServer, Reply


def forecast_entry(location: str) -> dict[str, object]:
    data = [
        {
            "location": "IE",
            "timestamp": f"2024-03-06T{19 + m // 60:02d}:{m % 60:02d}:00+00:00",
            "duration": 10,
            "value": 448.45 - m,
        }
        for m in range(0, 180, 10)
    ]
    return {
        "generatedAt": "2024-03-06T19:05:00+00:00",
        "requestedAt": "2024-03-06T19:10:00+00:00",
        "location": location,
        "dataStartAt": "2024-03-06T19:00:00+00:00",
        "dataEndAt": "2024-03-06T22:00:00+00:00",
        "windowSize": 10,
        "optimalDataPoints": [data[-1]],
        "forecastData": data,
    }


BYLOCATION = [
    {
        "location": "northeurope",
        "time": "2024-03-06T18:05:00+00:00",
        "rating": 410.0,
        "duration": "00:05:00",
    },
    {
        "location": "northeurope",
        "time": "2024-03-06T19:10:00+00:00",
        "rating": 420.0,
        "duration": "00:05:00",
    },
]


def provider(server: FakeServer, clock: FakeClock, http: HttpSettings) -> CarbonAwareSdkProvider:
    return CarbonAwareSdkProvider("northeurope", server.base_url, settings=http, clock=clock)


async def test_forecast_with_current(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/emissions/forecasts/current", Reply(body=[forecast_entry("northeurope")]))
    fake_server.route("/emissions/bylocation", Reply(body=BYLOCATION))
    p = provider(fake_server, clock, fast_http)
    forecast = await p.get_forecast(3600)
    await p.aclose()
    assert forecast.points[0].intensity_g_per_kwh == 420.0  # latest measured rating
    assert forecast.points[0].kind == PointKind.MEASURED
    # Forecast points after the measured one follow (19:20 onwards).
    assert forecast.points[1].intensity_g_per_kwh == pytest.approx(448.45 - 20)
    assert fake_server.requests[0].query["location"] == ["northeurope"]


async def test_no_current_data_204(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route("/emissions/forecasts/current", Reply(body=[forecast_entry("northeurope")]))
    fake_server.route("/emissions/bylocation", Reply(204))
    p = provider(fake_server, clock, fast_http)
    forecast = await p.get_forecast(3600)
    await p.aclose()
    # The forecast point holding at 19:10 (the 19:10 slot) stands in for now.
    assert forecast.points[0].intensity_g_per_kwh == pytest.approx(448.45 - 10)
    assert forecast.points[0].kind == PointKind.FORECAST


async def test_no_forecast_501(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/emissions/forecasts/current",
        Reply(
            501,
            {
                "type": "about:blank",
                "title": "NotImplemented",
                "status": 501,
                "detail": "This data source does not support forecasts",
            },
        ),
    )
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(ProviderNoData, match="no forecast"):
        await p.get_forecast(3600)
    await p.aclose()


async def test_validation_problem(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/emissions/forecasts/current",
        Reply(
            400,
            {
                "type": "https://tools.ietf.org/html/rfc7231#section-6.5.1",
                "title": "One or more validation errors occurred.",
                "status": 400,
                "detail": None,
                "errors": {"location": ["Unknown location 'mars'"]},
            },
            "application/problem+json",
        ),
    )
    p = provider(fake_server, clock, fast_http)
    with pytest.raises(ProviderRequestError, match="location: Unknown location 'mars'"):
        await p.get_forecast(3600)
    await p.aclose()
