"""Forecast skill per horizon: blending the provider's forecast with ours, and the upper quantile.

The providers are real clients against local fake servers in the documented formats
(../shared/CARBON_APIS.md); the clock is stepped an hour at a time.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from energy_model.carbon import ResilientCarbonSource
from energy_model.carbon.base import HttpSettings
from energy_model.carbon.electricitymaps import ElectricityMapsProvider
from energy_model.carbon.forecast import PointKind
from energy_model.carbon.skill import (
    PRIOR_UPPER_LOG_ERROR_Q80,
    ForecastSkill,
    floor_hour,
    prior_upper_factor,
)
from energy_model.carbon.uk import UkCarbonIntensityProvider
from energy_model.carbon.watttime import G_PER_KWH_PER_LBS_PER_MWH, WattTimeProvider
from tests.energy_model.conftest import FakeClock
from tests.energy_model.fake_http import FakeServer, Reply, Seen

T0 = datetime(2024, 3, 4, 0, tzinfo=UTC)


def truth(at: datetime) -> float:
    """A grid with an exact daily cycle: yesterday's value is today's."""
    hour = at.hour + at.minute / 60
    return 300.0 + 100.0 * math.sin(2 * math.pi * hour / 24)


def em_iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:00.000Z")


def test_skill_scores_each_method_per_horizon_and_weights_the_better_one() -> None:
    skill = ForecastSkill(horizon_h=4, min_samples=5)
    actual = {T0 + timedelta(hours=i): 100.0 for i in range(40)}
    for i in range(30):
        origin = T0 + timedelta(hours=i)
        skill.issue("provider", origin, [100.0, 100.0, 150.0, 150.0])  # wrong from 3 h on
        skill.issue("local", origin, [120.0, 120.0, 110.0, 110.0])
        skill.issue("final", origin, [90.0] * 4)  # 10 % low everywhere
    weights = skill.provider_weights(actual)
    assert weights[0] == pytest.approx(1.0, abs=1e-6)  # the provider was exact at 1-2 h
    assert weights[2] < 0.2  # and far off at 3-4 h, where ours was closer
    factors, measured = skill.upper_factors(actual)
    assert measured.all()
    assert factors == pytest.approx(np.full(4, 100 / 90))
    rows = skill.report(actual)
    assert rows[2].provider_mape == pytest.approx(50.0)  # |100 - 150| / 100
    assert rows[0].provider_samples == 30


def test_skill_keeps_the_longest_forecast_of_an_hour_and_forgets_old_ones() -> None:
    skill = ForecastSkill(horizon_h=3, window_h=5, min_samples=1)
    skill.issue("final", T0, [1.0])
    skill.issue("final", T0, [2.0, 2.0, 2.0])
    skill.issue("final", T0, [3.0, 3.0])
    assert skill.issued["final"][T0].tolist() == [2.0, 2.0, 2.0]
    skill.issue("final", T0 + timedelta(hours=20), [1.0])
    assert T0 not in skill.issued["final"]
    with pytest.raises(ValueError, match="unknown method"):
        skill.issue("oracle", T0, [1.0])


def test_without_measurements_the_bench_prior_sets_the_upper_quantile() -> None:
    skill = ForecastSkill(horizon_h=30)
    factors, measured = skill.upper_factors({})
    assert not measured.any()
    assert factors[0] == pytest.approx(math.exp(PRIOR_UPPER_LOG_ERROR_Q80[0]))
    assert factors[29] == pytest.approx(math.exp(PRIOR_UPPER_LOG_ERROR_Q80[-1]))
    assert prior_upper_factor(6, 0.95) > prior_upper_factor(6, 0.8) > prior_upper_factor(6, 0.5)
    assert prior_upper_factor(6, 0.5) == pytest.approx(1.0)


def em_routes(server: FakeServer, clock: FakeClock, bias: float) -> None:
    def latest(_: Seen) -> Reply:
        hour = floor_hour(clock())
        return Reply(
            body={
                "zone": "DE",
                "carbonIntensity": round(truth(hour)),
                "datetime": em_iso(hour),
                "updatedAt": em_iso(clock()),
                "createdAt": em_iso(hour),
                "emissionFactorType": "lifecycle",
                "isEstimated": False,
                "estimationMethod": None,
            }
        )

    def history(_: Seen) -> Reply:
        hour = floor_hour(clock())
        items = [
            {
                "zone": "DE",
                "carbonIntensity": round(truth(hour - timedelta(hours=k))),
                "datetime": em_iso(hour - timedelta(hours=k)),
                "emissionFactorType": "lifecycle",
                "isEstimated": False,
                "estimationMethod": None,
            }
            for k in range(24, 0, -1)
        ]
        return Reply(body={"zone": "DE", "history": items})

    def forecast(_: Seen) -> Reply:
        hour = floor_hour(clock())
        items = [
            {
                "carbonIntensity": round(truth(hour + timedelta(hours=k)) * bias),
                "datetime": em_iso(hour + timedelta(hours=k)),
            }
            for k in range(1, 25)
        ]
        return Reply(body={"zone": "DE", "forecast": items, "updatedAt": em_iso(clock())})

    server.route("/carbon-intensity/latest", latest)
    server.route("/carbon-intensity/history", history)
    server.route("/carbon-intensity/forecast", forecast)


async def test_a_biased_provider_forecast_is_blended_towards_ours_as_skill_is_measured(
    fake_server: FakeServer, fast_http: HttpSettings
) -> None:
    clock = FakeClock(T0 + timedelta(minutes=5))
    em_routes(fake_server, clock, bias=1.3)
    provider = ElectricityMapsProvider(
        "DE", "token", fake_server.base_url, settings=fast_http, clock=clock
    )
    source = ResilientCarbonSource(
        provider, 700.0, clock=clock, skill=ForecastSkill(horizon_h=24, min_samples=6)
    )
    first = await source.get_forecast(12 * 3600)
    # Nothing scored yet: the provider's forecast stands, with the prior's upper quantile.
    at_3h = first.intensity_at(floor_hour(clock()) + timedelta(hours=3, minutes=30))
    assert at_3h == pytest.approx(round(truth(T0 + timedelta(hours=3)) * 1.3))
    assert "blended" not in first.source
    assert first.upper_quantile == 0.8
    ahead = [p for p in first.points if p.kind == PointKind.FORECAST]
    assert all(p.upper_g_per_kwh and p.upper_g_per_kwh > p.intensity_g_per_kwh for p in ahead)
    for _ in range(30):
        clock.advance(3600)
        forecast = await source.get_forecast(12 * 3600)
    await source.aclose()
    # The history came from /history once an hour plus the latest values.
    assert fake_server.hits["/carbon-intensity/history"] == 31
    weights = source.skill.provider_weights(source.history)
    assert weights[:6].max() < 0.05  # ours was exact on a periodic grid, the provider 30 % high
    assert "blended with local" in forecast.source
    hour = floor_hour(clock())
    for h in (1, 3, 6):
        expected = truth(hour + timedelta(hours=h))
        assert forecast.intensity_at(hour + timedelta(hours=h, minutes=30)) == pytest.approx(
            expected, rel=0.03
        )
    rows = source.skill.report(source.history)
    assert rows[2].provider_mape == pytest.approx(30.0, abs=1.5)  # forecast 1.3x the actual
    assert rows[2].local_mape is not None and rows[2].local_mape < 1.0


async def test_watttime_history_and_five_minute_forecast_feed_the_skill(
    fake_server: FakeServer, fast_http: HttpSettings
) -> None:
    clock = FakeClock(T0 + timedelta(minutes=2))
    lbs = 1 / G_PER_KWH_PER_LBS_PER_MWH

    def points(start: datetime, end: datetime, scale: float) -> list[dict[str, object]]:
        out = []
        at = start.replace(minute=start.minute - start.minute % 5, second=0, microsecond=0)
        while at < end:
            out.append({"point_time": at.isoformat(), "value": truth(at) * scale * lbs})
            at += timedelta(minutes=5)
        return out

    meta = {
        "data_point_period_seconds": 300,
        "region": "CAISO_NORTH",
        "signal_type": "co2_moer",
        "units": "lbs_co2_per_mwh",
        "generated_at": "2024-03-04T00:00:00+00:00",
    }

    def forecast(seen: Seen) -> Reply:
        hours = int(seen.query["horizon_hours"][0])
        now = clock()
        return Reply(body={"data": points(now, now + timedelta(hours=hours), 1.2), "meta": meta})

    def historical(seen: Seen) -> Reply:
        start = datetime.fromisoformat(seen.query["start"][0])
        end = datetime.fromisoformat(seen.query["end"][0])
        return Reply(body={"data": points(start, end, 1.0), "meta": meta})

    fake_server.route("/login", Reply(body={"token": "t"}))
    fake_server.route("/v3/forecast", forecast)
    fake_server.route("/v3/historical", historical)
    provider = WattTimeProvider(
        "CAISO_NORTH", "u", "p", fake_server.base_url, settings=fast_http, clock=clock
    )
    source = ResilientCarbonSource(
        provider, 700.0, clock=clock, skill=ForecastSkill(horizon_h=12, min_samples=4)
    )
    for _ in range(12):
        latest = await source.get_forecast(6 * 3600)
        clock.advance(3600)
    await source.aclose()
    # 24 h of observed MOER at the first call, then each hour's new part.
    assert len(source.history) >= 24 + 11
    history_q = [s for s in fake_server.requests if s.path == "/v3/historical"]
    assert all(q.query["start"][0].endswith("+00:00") for q in history_q)  # must carry a zone
    rows = source.skill.report(source.history)
    assert rows[0].provider_samples >= 4
    assert rows[0].provider_mape == pytest.approx(20.0, abs=2.0)
    assert source.skill.provider_weights(source.history)[0] < 0.2
    assert "blended with local" in latest.source
    assert latest.signal.value == "marginal_moer"


async def test_uk_actuals_of_the_last_day_are_the_history(
    fake_server: FakeServer, fast_http: HttpSettings
) -> None:
    clock = FakeClock(T0 + timedelta(hours=12, minutes=10))

    def fmt(at: datetime) -> str:
        return at.strftime("%Y-%m-%dT%H:%MZ")

    def periods(start: datetime, count: int, with_actual: bool) -> list[dict[str, object]]:
        start = start.replace(minute=start.minute - start.minute % 30)  # whole half hours
        return [
            {
                "from": fmt(start + timedelta(minutes=30 * k)),
                "to": fmt(start + timedelta(minutes=30 * (k + 1))),
                "intensity": {
                    "forecast": round(truth(start + timedelta(minutes=30 * k)) * 1.1),
                    "actual": round(truth(start + timedelta(minutes=30 * k)))
                    if with_actual
                    else None,
                    "index": "moderate",
                },
            }
            for k in range(count)
        ]

    def route(seen: Seen) -> Reply:
        if seen.path.endswith("/pt24h"):
            return Reply(body={"data": periods(clock() - timedelta(hours=24), 48, True)})
        return Reply(body={"data": periods(clock() - timedelta(minutes=40), 48, False)})

    fake_server.routes.clear()
    now = clock()
    fake_server.route(f"/intensity/{fmt(now)}/pt24h", route)
    fake_server.route(f"/intensity/{fmt(now - timedelta(minutes=30))}/fw24h", route)
    source = ResilientCarbonSource(
        UkCarbonIntensityProvider(
            "national", fake_server.base_url, settings=fast_http, clock=clock
        ),
        700.0,
        clock=clock,
    )
    forecast = await source.get_forecast(6 * 3600)
    await source.aclose()
    assert len(source.history) == 24
    assert source.history[T0 + timedelta(hours=3)] == pytest.approx(
        round(truth(T0 + timedelta(hours=3, minutes=30)))
    )
    assert forecast.upper_quantile == 0.8
    assert forecast.points[0].upper_g_per_kwh is not None
