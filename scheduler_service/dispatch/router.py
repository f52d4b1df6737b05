"""The current plan: GPUs per job per slot, with projected energy and emissions."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel

from scheduler_service.deps import SessionDep, UserOrOperator
from scheduler_service.dispatch.plans import plan_contents
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.exceptions import error_responses

NO_PLAN = "no plan yet: the control loop has not planned any job"

router = APIRouter(prefix="/v1", tags=["plan"], responses=error_responses(401, 403))


class PlanOut(BaseModel):
    """The newest plan the control loop made."""

    created_at: datetime
    start_at: datetime
    slot_s: float
    policy: str
    status: str
    gap: float | None
    solve_s: float
    energy_kwh: float
    emissions_kg: float
    forecast_degraded: bool
    gpus_by_job: dict[str, list[int]]
    slots: list[dict[str, Any]]
    deadline_misses: dict[str, str]


@router.get("/plan", responses=error_responses(404))
def current_plan(
    session: SessionDep,
    caller: UserOrOperator,
    job: Annotated[
        int | None, Query(ge=1, description="Only this job's rows (if the caller may see it).")
    ] = None,
) -> PlanOut:
    """The current plan (users see only their own jobs' rows)."""
    repo = AllocationRepository(session)
    # The plan's GPUs per job and slot are stored only as per-job rows: one job's or one
    # user's are read without the others'.
    header = repo.latest_plan_header()
    if header is None:
        raise HTTPException(404, detail=NO_PLAN)
    rows = repo.plan_jobs(
        header.id,
        job_ids=[job] if job is not None else None,
        owner=None if caller.is_operator else caller.name,
    )
    gpus_by_job, deadline_misses = plan_contents(rows, header.num_slots)
    return PlanOut(
        created_at=header.created_at,
        start_at=header.start_at,
        slot_s=header.slot_s,
        policy=header.policy,
        status=header.status,
        gap=header.gap,
        solve_s=header.solve_s,
        energy_kwh=header.energy_kwh,
        emissions_kg=header.emissions_kg,
        forecast_degraded=header.forecast_degraded,
        gpus_by_job=gpus_by_job,
        slots=repo.plan_slots(header.id),
        deadline_misses=deadline_misses,
    )
