"""The failure policy (ResilientCarbonSource) and the provider factory."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from energy_model.carbon import (
    CarbonConfig,
    CarbonForecast,
    ForecastPoint,
    PointKind,
    ProviderConfigError,
    ProviderUnavailable,
    ResilientCarbonSource,
    Signal,
    build_provider,
    build_source,
)
from energy_model.carbon.carbon_aware_sdk import CarbonAwareSdkProvider
from energy_model.carbon.electricitymaps import ElectricityMapsProvider
from energy_model.carbon.synthetic import SyntheticProvider
from energy_model.carbon.trace import TraceProvider
from energy_model.carbon.uk import UkCarbonIntensityProvider
from energy_model.carbon.watttime import WattTimeProvider
from tests.energy_model.conftest import FakeClock
from tests.energy_model.fake_http import FakeServer, Reply


class ScriptedProvider:
    """Returns forecasts built from the clock, or raises, as the test says."""

    name = "scripted"
    region = "R"

    def __init__(self, clock: FakeClock, hours: int = 6) -> None:
        self.clock = clock
        self.hours = hours
        self.fail: Exception | None = None
        self.calls = 0

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        now = self.clock()
        points = [ForecastPoint(at=now, intensity_g_per_kwh=100.0, kind=PointKind.MEASURED)]
        points += [
            ForecastPoint(
                at=now + timedelta(hours=h), intensity_g_per_kwh=100.0 + h, kind=PointKind.FORECAST
            )
            for h in range(1, self.hours)
        ]
        return CarbonForecast(
            region="R",
            source="scripted",
            signal=Signal.AVERAGE_LCA,
            fetched_at=now,
            points=tuple(points),
        )

    async def aclose(self) -> None:
        return None


async def test_fresh_forecast_passes_through(clock: FakeClock) -> None:
    src = ResilientCarbonSource(ScriptedProvider(clock), 700.0, 3600, clock)
    f = await src.get_forecast(5 * 3600)
    assert not f.degraded and f.now_g_per_kwh == 100.0 and len(f.points) == 6


async def test_falls_back_to_cache_then_conservative(clock: FakeClock) -> None:
    provider = ScriptedProvider(clock)
    src = ResilientCarbonSource(provider, 650.0, max_forecast_age_s=3600, clock=clock)
    await src.get_forecast(5 * 3600)
    provider.fail = ProviderUnavailable("scripted", "GET /x timed out after 10 s")
    clock.advance(1800)
    f = await src.get_forecast(7 * 3600)
    assert f.degraded
    assert "timed out" in (f.degraded_reason or "") and "1800 s ago" in (f.degraded_reason or "")
    assert f.points[0].at == clock.now
    assert f.now_g_per_kwh == 100.0  # the cached hour holding at now
    assert f.points[1].intensity_g_per_kwh == 101.0
    # Beyond what the cache knew: the conservative value, never cleaner.
    # (cached points run to now + 4.5 h, each holding an hour.)
    assert f.intensity_at(clock.now + timedelta(hours=5)) == 105.0
    assert f.intensity_at(clock.now + timedelta(hours=6)) == 650.0
    clock.advance(3600)
    f = await src.get_forecast(5 * 3600)
    assert f.degraded and "conservative 650 g/kWh" in (f.degraded_reason or "")
    assert f.intensity_g_per_kwh == (650.0,)
    assert src.last_error is not None
    provider.fail = None
    f = await src.get_forecast(3600)
    assert not f.degraded and src.last_error is None


async def test_no_cache_goes_straight_to_conservative(clock: FakeClock) -> None:
    provider = ScriptedProvider(clock)
    provider.fail = ProviderConfigError("scripted", "bad key")
    src = ResilientCarbonSource(provider, 500.0, clock=clock)
    f = await src.get_forecast(3600)
    assert f.degraded and "no earlier forecast" in (f.degraded_reason or "")
    assert f.now_g_per_kwh == 500.0 and f.points[0].kind == PointKind.ESTIMATED


async def test_short_forecast_is_extended(clock: FakeClock) -> None:
    provider = ScriptedProvider(clock, hours=3)
    src = ResilientCarbonSource(provider, 800.0, clock=clock)
    f = await src.get_forecast(10 * 3600)
    assert not f.degraded
    assert len(f.points) == 10 and "extended" in f.source
    # Too little history for the forecaster yet: the conservative value fills the rest.
    assert f.points[-1].intensity_g_per_kwh == 800.0
    for _ in range(30):  # a day and more of hourly observations
        clock.advance(3600)
        f = await src.get_forecast(10 * 3600)
    assert "seasonal_naive" in f.source
    assert max(f.intensity_g_per_kwh) < 800.0


async def test_resilient_over_real_http_provider(fake_server: FakeServer, clock: FakeClock) -> None:
    fake_server.route(
        "/carbon-intensity/latest",
        Reply(
            body={
                "zone": "DE",
                "carbonIntensity": 300,
                "datetime": "2024-03-06T19:00:00.000Z",
                "isEstimated": False,
            }
        ),
        Reply(503, "<html>Service Unavailable</html>", "text/html"),
    )
    fake_server.route("/carbon-intensity/forecast", Reply(body={"zone": "DE", "forecast": []}))
    from energy_model.carbon.base import HttpSettings

    http = HttpSettings(timeout_s=0.2, attempts=2, backoff_initial_s=0.01, backoff_max_s=0.01)
    p = ElectricityMapsProvider("DE", "k", fake_server.base_url, settings=http, clock=clock)
    src = ResilientCarbonSource(p, 700.0, 3600, clock)
    assert not (await src.get_forecast(3600)).degraded
    clock.advance(600)
    f = await src.get_forecast(3600)
    assert f.degraded and "503" in (f.degraded_reason or "") and f.now_g_per_kwh == 300
    await src.aclose()


def test_factory_names(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("time,intensity\n2024-01-01T00:00Z,100\n2024-01-01T01:00Z,90\n")
    assert isinstance(
        build_provider("electricitymaps", region="DE", api_key="k"), ElectricityMapsProvider
    )
    wt = build_provider("watttime", region="CAISO_NORTH", api_key="alice:pw")
    assert isinstance(wt, WattTimeProvider)
    assert isinstance(build_provider("uk", region=""), UkCarbonIntensityProvider)
    assert isinstance(build_provider("carbon-aware-sdk", region="eastus"), CarbonAwareSdkProvider)
    assert isinstance(build_provider("trace", region="", trace_path=trace), TraceProvider)
    assert isinstance(build_provider("synthetic", region="", clock_speedup=60), SyntheticProvider)
    with pytest.raises(ProviderConfigError, match="unknown carbon provider"):
        build_provider("nope", region="x")
    with pytest.raises(ProviderConfigError, match="trace_path"):
        build_provider("trace", region="x")
    with pytest.raises(ProviderConfigError, match="token"):
        build_provider("electricitymaps", region="DE")


async def test_build_source_from_config(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    src = build_source(CarbonConfig(provider="synthetic", clock_speedup=3600), clock=clock)
    f = await src.get_forecast(10)
    assert f.source.startswith("synthetic") and len(f.points) == 10
    monkeypatch.delenv("GF_TEST_EM_KEY", raising=False)
    with pytest.raises(ProviderConfigError, match="GF_TEST_EM_KEY is not set"):
        build_source(
            CarbonConfig(provider="electricitymaps", region="DE", api_key_env="GF_TEST_EM_KEY")
        )
    monkeypatch.setenv("GF_TEST_EM_KEY", "secret")
    src = build_source(
        CarbonConfig(provider="electricitymaps", region="DE", api_key_env="GF_TEST_EM_KEY")
    )
    assert isinstance(src.provider, ElectricityMapsProvider)
    await src.aclose()
