"""The scheduler's view of grid carbon: fetch through the failure policy, store what was seen."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from energy_model.carbon.factory import CarbonConfig, build_source
from energy_model.carbon.forecast import CarbonForecast, PointKind
from energy_model.carbon.resilient import HISTORY_POINTS, ResilientCarbonSource
from energy_model.carbon.trace import TraceProvider
from scheduler_service.budget.periods import ReplayClock, register_replay_clock
from scheduler_service.carbon.repository import CarbonRepository
from scheduler_service.db.models import CarbonForecastRecord, CarbonIntensitySample


def make_carbon_source(config: CarbonConfig) -> ResilientCarbonSource:
    """The configured provider wrapped in energy_model's failure policy (cache, conservative value);
    a replay's carbon clock is registered for budget periods on it (`budget.period_clock`)."""
    source = build_source(config)
    provider = source.provider
    register_replay_clock(
        ReplayClock(
            speedup=provider.clock_speedup,
            wall_anchor_at=provider.wall_start_at,
            carbon_anchor_at=provider.series_anchor_at,
        )
        if isinstance(provider, TraceProvider)
        else None
    )
    return source


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
                    "upper_g_per_kwh": p.upper_g_per_kwh,
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


def seed_history(session: Session, source: ResilientCarbonSource, now: datetime) -> int:
    """Give the source the intensity observed in the last weeks (kept across restarts); how many."""
    samples = CarbonRepository(session).observed_since(
        source.region, now - timedelta(hours=HISTORY_POINTS)
    )
    source.seed_history([(s.at, s.intensity_g_per_kwh) for s in samples])
    return len(samples)


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
