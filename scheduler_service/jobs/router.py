"""HTTP endpoints of the jobs API (thin: parse, call the service, shape the answer)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import APIRouter, Body, Path, Query, Request, Response, status
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from scheduler_service.db.session import transaction
from scheduler_service.deps import ConfigDep, Operator, SessionDep, UserOrOperator
from scheduler_service.exceptions import error_responses
from scheduler_service.jobs import logs, service
from scheduler_service.jobs.logs import LogStream
from scheduler_service.jobs.schemas import (
    CancelRequest,
    GpuRange,
    JobEventOut,
    JobOut,
    JobPage,
    JobSpec,
    PriorityChange,
)
from scheduler_service.jobs.states import JobState
from worker_agent.protocol import (
    MAX_CURVE_POINTS,
    MAX_LOG_CHUNK_BYTES,
    MAX_SLOTS,
    JobLogChunk,
    JobScalarCurve,
)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 403, 429))

T = TypeVar("T")
# A state change that races another (the control loop, an operator) is redone from a fresh
# read this many times before the caller gets 409.
RACE_ATTEMPTS = 5


def _unit_of_work(
    request: Request, work: Callable[[Session], T], *, also: tuple[type[Exception], ...] = ()
) -> T:
    """Run `work` in its own transaction, again from scratch (bounded) if a concurrent change
    made it stale (or raised one of `also`)."""
    # A plain loop, not a retry object per request: this wraps every submission.
    retried: tuple[type[Exception], ...] = (StaleDataError, *also)
    for attempt in range(1, RACE_ATTEMPTS + 1):
        try:
            with transaction(request.app.state.session_factory) as session:
                return work(session)
        except retried:
            if attempt == RACE_ATTEMPTS:
                raise
            time.sleep(random.uniform(0.005, 0.05))
    raise AssertionError("unreachable: the last attempt returns or raises")


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
    caller: UserOrOperator,
    config: ConfigDep,
    response: Response,
    request: Request,
) -> JobOut:
    """Submit a training job (idempotent per submission_id; a deadline must be meetable)."""
    # A repeated or concurrent submission_id hits the unique index on insert (the first try does
    # not look for it: a round trip saved on every new submission); redone, the submission finds
    # the job stored before and answers 200 with it.
    duplicate = (IntegrityError,) if spec.submission_id is not None else ()
    tries = 0

    def submit(session: Session) -> service.SubmitResult:
        nonlocal tries
        tries += 1
        admission = request.app.state.admission
        return service.submit_job(session, caller, spec, config, admission, look_up=tries > 1)

    result = _unit_of_work(request, submit, also=duplicate)
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
    caller: UserOrOperator,
    request: Request,
    body: Annotated[CancelRequest | None, Body()] = None,
) -> JobOut:
    """Cancel a job (repeating it is harmless; a finished job cannot be cancelled)."""
    reason = (body or CancelRequest()).reason
    job = _unit_of_work(request, lambda s: service.cancel_job(s, caller, job_id, reason=reason))
    request.app.state.wake_control_loop()
    return JobOut.model_validate(job)


@router.post("/{job_id}/hold", responses=error_responses(404, 409))
def hold_job(job_id: JobId, caller: Operator, request: Request) -> JobOut:
    """Keep a job off the GPUs until released (operators)."""
    job = _unit_of_work(request, lambda s: service.set_hold(s, caller, job_id, held=True))
    return JobOut.model_validate(job)


@router.post("/{job_id}/release", responses=error_responses(404, 409))
def release_job(job_id: JobId, caller: Operator, request: Request) -> JobOut:
    """Let a held job be scheduled again (operators)."""
    job = _unit_of_work(request, lambda s: service.set_hold(s, caller, job_id, held=False))
    return JobOut.model_validate(job)


@router.post("/{job_id}/gpus", responses=error_responses(400, 404, 409))
def change_gpu_range(
    job_id: JobId,
    caller: Operator,
    body: GpuRange,
    request: Request,
) -> JobOut:
    """Change the GPUs a job may run on (operators; not on a finished job): the next plan keeps
    it within `min_gpus`..`max_gpus`, hot-switching a running job that is outside."""
    job = _unit_of_work(
        request,
        lambda s: service.set_gpu_range(
            s, caller, job_id, min_gpus=body.min_gpus, max_gpus=body.max_gpus
        ),
    )
    request.app.state.wake_control_loop()
    return JobOut.model_validate(job)


@router.post("/{job_id}/priority", responses=error_responses(400, 404, 409))
def change_priority(
    job_id: JobId,
    caller: Operator,
    body: PriorityChange,
    request: Request,
) -> JobOut:
    """Change a job's priority (operators; not on a finished job)."""
    job = _unit_of_work(
        request, lambda s: service.set_priority(s, caller, job_id, priority=body.priority)
    )
    return JobOut.model_validate(job)


@router.get(
    "/{job_id}/logs",
    responses={
        **error_responses(404),
        503: {"description": "The node holding the output does not answer."},
    },
)
def get_job_logs(
    job_id: JobId,
    caller: UserOrOperator,
    request: Request,
    rank: Annotated[int, Query(ge=0, le=MAX_SLOTS)] = 0,
    stream: LogStream = "output",
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_LOG_CHUNK_BYTES)] = 65536,
    tail: Annotated[int | None, Query(ge=1, le=MAX_LOG_CHUNK_BYTES)] = None,
) -> JobLogChunk:
    """A piece of a job's output (stdout/stderr of the worker at `rank`, or its `greenflow_log`
    scalars as JSON lines), fetched from the agent of the node it runs or ran on; read on from
    `next_offset`. `tail=N`: the newest N bytes instead (from a line start)."""
    with transaction(request.app.state.session_factory) as session:
        source = logs.log_source(session, caller, job_id, request.app.state.node_secrets)
    # No transaction is held while the agent answers.
    return logs.fetch_chunk(
        source, job_id, rank=rank, stream=stream, offset=offset, limit=limit, tail=tail
    )


@router.get(
    "/{job_id}/curve",
    responses={
        **error_responses(404),
        503: {"description": "The node holding the scalars does not answer."},
    },
)
def get_job_curve(
    job_id: JobId,
    caller: UserOrOperator,
    request: Request,
    max_points: Annotated[int, Query(ge=2, le=MAX_CURVE_POINTS)] = 1000,
) -> JobScalarCurve:
    """The job's `greenflow_log` scalars per step (each name's mean over every rank and
    micro-batch of that step, across hot switches), at most `max_points` steps, newest kept."""
    with transaction(request.app.state.session_factory) as session:
        source = logs.log_source(session, caller, job_id, request.app.state.node_secrets)
    return logs.fetch_curve(source, job_id, max_points=max_points)
