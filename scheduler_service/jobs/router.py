"""HTTP endpoints of the jobs API (thin: parse, call the service, shape the answer)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Query, Request, Response, status

from scheduler_service.deps import ConfigDep, Operator, SessionDep, UserOrOperator
from scheduler_service.exceptions import error_responses
from scheduler_service.jobs import service
from scheduler_service.jobs.schemas import (
    CancelRequest,
    JobEventOut,
    JobOut,
    JobPage,
    JobSpec,
    PriorityChange,
)
from scheduler_service.jobs.states import JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 403))

JobId = Annotated[int, Path(ge=1, le=2**62, description="The job's id.")]
Limit = Annotated[int, Query(ge=1, le=500)]
Offset = Annotated[int, Query(ge=0, le=10**9)]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": JobOut, "description": "Already submitted under this submission_id."},
        **error_responses(400, 409),
    },
)
def submit_job(
    spec: JobSpec,
    session: SessionDep,
    caller: UserOrOperator,
    config: ConfigDep,
    response: Response,
    request: Request,
) -> JobOut:
    """Submit a training job (idempotent per submission_id; a deadline must be meetable)."""
    result = service.submit_job(session, caller, spec, config)
    if not result.created:
        response.status_code = status.HTTP_200_OK
    else:
        request.app.state.wake_control_loop()
    return JobOut.model_validate(result.job)


@router.get("")
def list_jobs(
    session: SessionDep,
    caller: UserOrOperator,
    state: Annotated[
        list[JobState] | None, Query(description="Filter by state (repeatable).")
    ] = None,
    owner: Annotated[str | None, Query(max_length=100)] = None,
    queue: Annotated[str | None, Query(max_length=64)] = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> JobPage:
    """List jobs, newest first; users see their own, operators everyone's."""
    jobs, total = service.list_jobs(
        session, caller, states=state or [], owner=owner, queue=queue, limit=limit, offset=offset
    )
    return JobPage(
        items=[JobOut.model_validate(j) for j in jobs], total=total, limit=limit, offset=offset
    )


@router.get("/{job_id}", responses=error_responses(404))
def get_job(job_id: JobId, session: SessionDep, caller: UserOrOperator) -> JobOut:
    """One job."""
    return JobOut.model_validate(service.get_visible_job(session, caller, job_id))


@router.get("/{job_id}/events", responses=error_responses(404))
def get_job_events(
    job_id: JobId,
    session: SessionDep,
    caller: UserOrOperator,
    limit: Limit = 200,
    offset: Offset = 0,
) -> list[JobEventOut]:
    """A job's state changes and other events, oldest first."""
    events = service.job_events(session, caller, job_id, limit=limit, offset=offset)
    return [JobEventOut.model_validate(e) for e in events]


@router.post("/{job_id}/cancel", responses=error_responses(400, 404, 409))
def cancel_job(
    job_id: JobId,
    session: SessionDep,
    caller: UserOrOperator,
    request: Request,
    body: Annotated[CancelRequest | None, Body()] = None,
) -> JobOut:
    """Cancel a job (repeating it is harmless; a finished job cannot be cancelled)."""
    reason = (body or CancelRequest()).reason
    job = service.cancel_job(session, caller, job_id, reason=reason)
    request.app.state.wake_control_loop()
    return JobOut.model_validate(job)


@router.post("/{job_id}/hold", responses=error_responses(404, 409))
def hold_job(job_id: JobId, session: SessionDep, caller: Operator) -> JobOut:
    """Keep a job off the GPUs until released (operators)."""
    return JobOut.model_validate(service.set_hold(session, caller, job_id, held=True))


@router.post("/{job_id}/release", responses=error_responses(404, 409))
def release_job(job_id: JobId, session: SessionDep, caller: Operator) -> JobOut:
    """Let a held job be scheduled again (operators)."""
    return JobOut.model_validate(service.set_hold(session, caller, job_id, held=False))


@router.post("/{job_id}/priority", responses=error_responses(400, 404, 409))
def change_priority(
    job_id: JobId,
    session: SessionDep,
    caller: Operator,
    body: PriorityChange,
) -> JobOut:
    """Change a job's priority (operators)."""
    return JobOut.model_validate(
        service.set_priority(session, caller, job_id, priority=body.priority)
    )
