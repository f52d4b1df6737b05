"""Carbon endpoint: recent intensity and the latest forecast."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from scheduler_service.carbon.repository import CarbonRepository
from scheduler_service.db.base import utcnow
from scheduler_service.deps import SessionDep, UserOrOperator
from scheduler_service.exceptions import error_responses

router = APIRouter(prefix="/v1", tags=["carbon"], responses=error_responses(401, 403))


class IntensityPoint(BaseModel):
    """Intensity from `at` on."""

    at: datetime
    intensity_g_per_kwh: float
    kind: str
    # The forecast's upper quantile (what a hard budget plans with); None for older records.
    upper_g_per_kwh: float | None = None


class CarbonOut(BaseModel):
    """Recent measured intensity and the newest forecast."""

    region: str | None
    source: str | None
    signal: str | None
    fetched_at: datetime | None
    degraded: bool
    degraded_reason: str | None
    recent: list[IntensityPoint]
    forecast: list[IntensityPoint]


@router.get("/carbon")
def carbon(
    session: SessionDep,
    _caller: UserOrOperator,
    history_s: Annotated[
        int, Query(ge=0, le=30 * 86_400, description="How far back recent goes.")
    ] = 86_400,
) -> CarbonOut:
    """Recent intensity samples and the latest forecast (degraded when a fallback was used)."""
    repo = CarbonRepository(session)
    now = utcnow()
    recent = [
        IntensityPoint(at=s.at, intensity_g_per_kwh=s.intensity_g_per_kwh, kind=s.kind)
        for s in repo.samples_between(now - timedelta(seconds=history_s), now)
    ]
    latest = repo.latest_forecast()
    if latest is None:
        return CarbonOut(
            region=None,
            source=None,
            signal=None,
            fetched_at=None,
            degraded=False,
            degraded_reason=None,
            recent=recent,
            forecast=[],
        )
    return CarbonOut(
        region=latest.region,
        source=latest.source,
        signal=latest.signal,
        fetched_at=latest.fetched_at,
        degraded=latest.degraded,
        degraded_reason=latest.degraded_reason,
        recent=recent,
        forecast=[IntensityPoint.model_validate(p) for p in latest.points],
    )
