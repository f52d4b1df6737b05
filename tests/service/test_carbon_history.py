"""The carbon source keeps its observed history across a scheduler restart (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from energy_model.carbon import CarbonForecast, ForecastPoint, PointKind, Signal
from energy_model.carbon.resilient import ResilientCarbonSource
from scheduler_service.carbon.repository import CarbonRepository
from scheduler_service.carbon.service import record_forecast, seed_history
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from tests.api.conftest import database_url, postgres_server  # noqa: F401 (fixtures)

T0 = datetime(2026, 3, 2, tzinfo=UTC)


class _Provider:
    name = "scripted"
    region = "DE"

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        raise AssertionError("not called")

    async def aclose(self) -> None:
        return None


def _forecast(at: datetime, value: float, kind: PointKind) -> CarbonForecast:
    return CarbonForecast(
        region="DE",
        source="scripted",
        signal=Signal.AVERAGE_LCA,
        fetched_at=at,
        points=(
            ForecastPoint(at=at, intensity_g_per_kwh=value, kind=kind, upper_g_per_kwh=value),
            ForecastPoint(
                at=at + timedelta(hours=1),
                intensity_g_per_kwh=value,
                kind=PointKind.FORECAST,
                upper_g_per_kwh=value * 1.1,
            ),
        ),
        upper_quantile=0.8,
    )


def test_a_restarted_source_starts_from_the_stored_measured_history(database_url: str) -> None:  # noqa: F811
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    with transaction(factory) as session:
        for h in range(30):
            kind = PointKind.ESTIMATED if h == 29 else PointKind.MEASURED
            record_forecast(session, _forecast(T0 + timedelta(hours=h), 100.0 + h, kind))
    with transaction(factory) as session:
        source = ResilientCarbonSource(_Provider(), 700.0)
        seeded = seed_history(session, source, T0 + timedelta(hours=30))
        stored = CarbonRepository(session).latest_forecast()
        assert stored is not None and stored.points[1]["upper_g_per_kwh"] == pytest.approx(
            129 * 1.1
        )
    engine.dispose()
    # Estimated points are assumptions, not observations: only the 29 measured hours count.
    assert seeded == 29
    assert len(source.history) == 29
    assert source.history[T0 + timedelta(hours=5)] == 105.0
    assert len(source.history_hourly()) >= 24  # enough for our forecaster at once
