"""The current plan: GPUs per job per slot, with projected energy and emissions."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel

from scheduler_service.deps import SessionDep, UserOrOperator
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.exceptions import error_responses
from scheduler_service.jobs.repository import JobRepository

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
def current_plan(session: SessionDep, caller: UserOrOperator) -> PlanOut:
    """The current plan (users see only their own jobs' rows)."""
    plan = AllocationRepository(session).latest_plan()
    if plan is None:
        raise HTTPException(404, detail="no plan yet: the control loop has not planned any job")
    out = PlanOut.model_validate(plan, from_attributes=True)
    if not caller.is_operator:
        mine = {
            str(j.id)
            for j in JobRepository(session).page(
                owner=caller.name, states=[], queue=None, limit=10_000, offset=0
            )[0]
        }
        out.gpus_by_job = {k: v for k, v in out.gpus_by_job.items() if k in mine}
        out.deadline_misses = {k: v for k, v in out.deadline_misses.items() if k in mine}
    return out
