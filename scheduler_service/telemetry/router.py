"""Telemetry endpoints: agents report, users read their jobs' samples."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from sqlalchemy.exc import IntegrityError

from scheduler_service.db.session import run_in_transaction
from scheduler_service.deps import Agent, ConfigDep, SessionDep, UserOrOperator
from scheduler_service.exceptions import error_responses
from scheduler_service.jobs.service import get_visible_job
from scheduler_service.telemetry import service
from scheduler_service.telemetry.repository import TelemetryRepository
from scheduler_service.telemetry.schemas import TelemetryOut
from worker_agent.protocol import TelemetryAck, TelemetryReport

router = APIRouter(tags=["telemetry"], responses=error_responses(401, 403, 429))


@router.post("/v1/telemetry", responses=error_responses(400, 404))
def report_telemetry(
    body: TelemetryReport, agent: Agent, config: ConfigDep, request: Request
) -> TelemetryAck:
    """Store the calling node's telemetry batch and node power samples (idempotent per sample_id).

    Samples of jobs not placed on the caller's node, of a superseded generation, or beyond
    what its GPUs can do are refused: counted in `rejected` and in the
    `greenflow_telemetry_samples_rejected_total` metric, never stored."""
    cluster = config.cluster
    limits = service.TelemetryLimits(
        max_power_per_gpu_w=cluster.max_power_per_gpu_w,
        rate_factor=cluster.telemetry_rate_factor,
        grace_s=3 * cluster.agent_telemetry_interval_s + service.CLOCK_SKEW_S,
    )
    # Its own transaction, retried if the control loop changed one of the jobs meanwhile, or if
    # the agent's retry of a timed-out post inserted the same sample ids first (unique key): the
    # second attempt counts them as duplicates instead of answering 500.
    result = run_in_transaction(
        request.app.state.session_factory,
        lambda s: service.ingest(s, agent.name, body, limits),
        also_retry=(IntegrityError,),
    )
    counter = request.app.state.telemetry_rejected
    if result.rejected:
        for reason, job_ids in result.rejected.items():
            counter.labels(reason.value).inc(len(job_ids))
        request.app.state.telemetry_rejection_log.note(agent.name, result)
    for power_reason, count in result.node_power_rejected.items():
        counter.labels(power_reason.value).inc(count)
    if result.finished_job_ids:
        request.app.state.wake_control_loop()
    return TelemetryAck(
        stored=result.stored,
        duplicates=result.duplicates,
        rejected=result.rejected_count,
        node_power_stored=result.node_power_stored,
        node_power_rejected=sum(result.node_power_rejected.values()),
    )


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
