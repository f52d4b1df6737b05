"""Telemetry endpoints: agents report, users read their jobs' samples."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from scheduler_service.db.session import run_in_transaction
from scheduler_service.deps import Agent, SessionDep, UserOrOperator
from scheduler_service.exceptions import error_responses
from scheduler_service.jobs.service import get_visible_job
from scheduler_service.telemetry import service
from scheduler_service.telemetry.repository import TelemetryRepository
from scheduler_service.telemetry.schemas import TelemetryOut
from worker_agent.protocol import TelemetryAck, TelemetryReport

router = APIRouter(tags=["telemetry"], responses=error_responses(401, 403))


@router.post("/v1/telemetry", responses=error_responses(400))
def report_telemetry(body: TelemetryReport, _agent: Agent, request: Request) -> TelemetryAck:
    """Store an agent's telemetry batch (idempotent per sample_id)."""
    # Its own transaction, retried if the control loop changed one of the jobs meanwhile.
    result = run_in_transaction(
        request.app.state.session_factory, lambda s: service.ingest(s, body)
    )
    if result.finished_job_ids:
        request.app.state.wake_control_loop()
    return TelemetryAck(stored=result.stored, duplicates=result.duplicates)


@router.get("/v1/jobs/{job_id}/telemetry", responses=error_responses(404))
def job_telemetry(
    job_id: Annotated[int, Path(ge=1, le=2**62)],
    session: SessionDep,
    caller: UserOrOperator,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> list[TelemetryOut]:
    """A job's telemetry samples, oldest first (the newest `limit`)."""
    get_visible_job(session, caller, job_id)
    return [
        TelemetryOut.model_validate(s)
        for s in TelemetryRepository(session).for_job(job_id, limit=limit)
    ]
