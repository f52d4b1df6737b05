"""UK Carbon Intensity API client against a local fake server in the documented shape."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from energy_model.carbon import PointKind, ProviderConfigError, ProviderRequestError, Signal
from energy_model.carbon.base import HttpSettings
from energy_model.carbon.uk import UkCarbonIntensityProvider
from tests.energy_model.conftest import FakeClock
from tests.energy_model.fake_http import FakeServer, Reply


def fmt(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%MZ")


def periods(start: datetime, n: int, closed: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(n):
        a = start + timedelta(minutes=30 * i)
        out.append(
            {
                "from": fmt(a),
                "to": fmt(a + timedelta(minutes=30)),
                "intensity": {
                    "forecast": 200 + i,
                    "actual": 190 + i if i < closed else None,
                    "index": "moderate",
                },
            }
        )
    return out


async def test_national_fw24h(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    # now = 19:10; the client asks from 18:40, the API starts at the 18:30 slot.
    path = "/intensity/2024-03-06T18:40Z/fw24h"
    slot0 = datetime(2024, 3, 6, 18, 30, tzinfo=UTC)
    fake_server.route(path, Reply(body={"data": periods(slot0, 50, closed=2)}))
    p = UkCarbonIntensityProvider("national", fake_server.base_url, settings=fast_http, clock=clock)
    forecast = await p.get_forecast(2 * 3600)
    await p.aclose()
    assert forecast.signal == Signal.AVERAGE
    first = forecast.points[0]
    # 19:00 slot is current: its actual (191) is known; kind measured, re-stamped to now.
    assert first.at == clock.now and first.intensity_g_per_kwh == 191
    assert first.kind == PointKind.MEASURED
    assert forecast.points[1].kind == PointKind.FORECAST
    assert forecast.points[1].intensity_g_per_kwh == 202  # forecast, actual null
    assert len(forecast.points) == 5  # 19:10, 19:30, 20:00, 20:30, 21:00 (< 21:10)
    assert fake_server.requests[0].headers["Accept"] == "application/json"


async def test_regional_by_id(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    slot0 = datetime(2024, 3, 6, 19, 0, tzinfo=UTC)
    body = {
        "data": {
            "regionid": 13,
            "dnoregion": "UKPN London",
            "shortname": "London",
            "data": [
                {**p, "generationmix": [{"fuel": "gas", "perc": 43.6}]}
                for p in periods(slot0, 4, closed=0)
            ],
        }
    }
    fake_server.route("/regional/intensity/2024-03-06T18:40Z/fw48h/regionid/13", Reply(body=body))
    p = UkCarbonIntensityProvider(
        "regionid:13", fake_server.base_url, settings=fast_http, clock=clock
    )
    forecast = await p.get_forecast(3600)
    await p.aclose()
    assert [pt.intensity_g_per_kwh for pt in forecast.points] == [200, 201, 202]
    assert all(pt.kind == PointKind.FORECAST for pt in forecast.points)


async def test_regional_list_shape(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    slot0 = datetime(2024, 3, 6, 19, 0, tzinfo=UTC)
    body = {
        "data": [
            {
                "from": fmt(slot0 + timedelta(minutes=30 * i)),
                "to": fmt(slot0 + timedelta(minutes=30 * i + 30)),
                "regions": [
                    {
                        "regionid": 3,
                        "shortname": "North West England",
                        "intensity": {"forecast": 100 + i, "index": "low"},
                        "generationmix": [],
                    },
                    {
                        "regionid": 13,
                        "shortname": "London",
                        "intensity": {"forecast": 300 + i, "index": "high"},
                        "generationmix": [],
                    },
                ],
            }
            for i in range(3)
        ]
    }
    fake_server.route("/regional/intensity/2024-03-06T18:40Z/fw48h/regionid/3", Reply(body=body))
    p = UkCarbonIntensityProvider("3", fake_server.base_url, settings=fast_http, clock=clock)
    forecast = await p.get_forecast(3600)
    await p.aclose()
    assert [pt.intensity_g_per_kwh for pt in forecast.points] == [100, 101, 102]


async def test_error_body(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    fake_server.route(
        "/intensity/2024-03-06T18:40Z/fw24h",
        Reply(400, {"error": {"code": "400 Bad Request", "message": "Please enter a valid date"}}),
    )
    p = UkCarbonIntensityProvider(base_url=fake_server.base_url, settings=fast_http, clock=clock)
    with pytest.raises(ProviderRequestError, match="Please enter a valid date"):
        await p.get_forecast(3600)
    await p.aclose()


async def test_current_national(
    fake_server: FakeServer, clock: FakeClock, fast_http: HttpSettings
) -> None:
    slot0 = datetime(2024, 3, 6, 19, 0, tzinfo=UTC)
    fake_server.route("/intensity", Reply(body={"data": periods(slot0, 1, closed=0)}))
    p = UkCarbonIntensityProvider(base_url=fake_server.base_url, settings=fast_http, clock=clock)
    point = await p.current_national()
    await p.aclose()
    assert point.intensity_g_per_kwh == 200 and point.kind == PointKind.FORECAST


def test_bad_region() -> None:
    with pytest.raises(ProviderConfigError, match="region id"):
        UkCarbonIntensityProvider("london")
