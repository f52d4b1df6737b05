"""The scheduler's view of grid carbon: fetch through the failure policy, store what was seen."""

from __future__ import annotations

from sqlalchemy.orm import Session

from energy_model.carbon.factory import CarbonConfig as ProviderConfig
from energy_model.carbon.factory import build_source
from energy_model.carbon.forecast import CarbonForecast, PointKind
from energy_model.carbon.resilient import ResilientCarbonSource
from energy_model.carbon.trace import TraceProvider
from scheduler_service.carbon.repository import CarbonRepository
from scheduler_service.db.models import CarbonForecastRecord, CarbonIntensitySample
from scheduler_service.settings import CarbonConfig


def make_carbon_source(config: CarbonConfig) -> ResilientCarbonSource:
    """The configured provider wrapped in energy_model's failure policy (cache, conservative value)."""
    return build_source(
        ProviderConfig(
            provider=config.provider,
            region=config.region,
            api_key_env=config.api_key_env,
            base_url=config.base_url,
            trace_path=config.trace_path,
            clock_speedup=config.clock_speedup,
            forecast_mode=config.forecast_mode,
            conservative_intensity_g_per_kwh=config.conservative_intensity_g_per_kwh,
            max_forecast_age_s=config.max_forecast_age_s,
            seed=config.seed,
        )
    )


def record_forecast(session: Session, forecast: CarbonForecast) -> None:
    """Store a fetched forecast and its first point (the intensity now) as a sample."""
    repo = CarbonRepository(session)
    repo.add_forecast(
        CarbonForecastRecord(
            region=forecast.region,
            source=forecast.source,
            signal=forecast.signal.value,
            fetched_at=forecast.fetched_at,
            degraded=forecast.degraded,
            degraded_reason=forecast.degraded_reason,
            points=[
                {
                    "at": p.at.isoformat(),
                    "intensity_g_per_kwh": p.intensity_g_per_kwh,
                    "kind": p.kind.value,
                }
                for p in forecast.points
            ],
        )
    )
    record_intensity_now(session, forecast)


def record_intensity_now(session: Session, forecast: CarbonForecast) -> None:
    """Store a forecast's first point (the intensity now) as a sample; the ledger charges from these."""
    now = forecast.points[0]
    CarbonRepository(session).add_sample_once(
        CarbonIntensitySample(
            region=forecast.region,
            source=forecast.source,
            signal=forecast.signal.value,
            at=now.at,
            intensity_g_per_kwh=now.intensity_g_per_kwh,
            # A degraded "now" is an assumption, not a measurement.
            kind=PointKind.ESTIMATED.value if forecast.degraded else now.kind.value,
            fetched_at=forecast.fetched_at,
        )
    )


def anchor_replay(session: Session, source: ResilientCarbonSource) -> bool:
    """Resume a trace/synthetic replay where it was before a restart instead of rewinding it."""
    provider = source.provider
    if not isinstance(provider, TraceProvider):
        return False
    first = CarbonRepository(session).first_fetch_of(provider.source)
    if first is None or first >= provider.wall_start_at:
        return False
    # The replay's clock started when the first scheduler process fetched from it.
    provider.wall_start_at = first
    return True
