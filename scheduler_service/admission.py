"""Admission at submission (ElasticFlow semantics): a deadline is accepted only if a plan meets it."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from energy_model.carbon.forecast import CarbonForecast, ForecastPoint, PointKind, Signal
from energy_model.job_model import prior_job_model
from scheduler_service.allocation.policies import get_policy
from scheduler_service.allocation.problem import InvalidProblem, JobSpec, allowed_gpu_counts
from scheduler_service.allocation.solver import AdmissionDecision, admit
from scheduler_service.carbon.repository import CarbonRepository
from scheduler_service.jobs.schemas import JobSpec as JobRequest
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.planning import JobModels, build_problem
from scheduler_service.settings import GreenflowConfig

ADMISSION_TIME_LIMIT_S = 2.0


def _known_forecast(session: Session, config: GreenflowConfig, now: datetime) -> CarbonForecast:
    """The newest stored forecast, or the conservative intensity when none was fetched yet."""
    record = CarbonRepository(session).latest_forecast()
    if record is not None:
        points = tuple(ForecastPoint.model_validate(p) for p in record.points)
        forecast = CarbonForecast(
            region=record.region,
            source=record.source,
            signal=Signal(record.signal),
            fetched_at=record.fetched_at,
            points=points,
            degraded=record.degraded,
        )
        if forecast.points[0].at <= now:
            return forecast
    # Never assume a cleaner grid than known.
    return CarbonForecast(
        region=config.carbon.region,
        source="conservative",
        signal=Signal.AVERAGE,
        fetched_at=now,
        degraded=True,
        degraded_reason="no forecast fetched yet",
        points=(
            ForecastPoint(
                at=now - timedelta(seconds=1),
                intensity_g_per_kwh=config.carbon.conservative_intensity_g_per_kwh,
                kind=PointKind.ESTIMATED,
            ),
        ),
    )


def check_admission(
    session: Session,
    config: GreenflowConfig,
    request: JobRequest,
    total_samples: int,
    now: datetime,
) -> AdmissionDecision:
    """Whether a job with a deadline can be admitted without breaking admitted jobs' deadlines."""
    nodes = NodeRepository(session).nodes_with_slots(ready_only=True)
    largest = max((len(n.slots) for n in nodes), default=0)
    if largest == 0:
        return AdmissionDecision(False, False, "no GPUs are registered with the scheduler", None)
    try:
        allowed = allowed_gpu_counts(request.min_gpus, min(request.max_gpus, largest))
    except InvalidProblem:
        return AdmissionDecision(
            False,
            False,
            f"needs at least {request.min_gpus} GPUs on one node; the largest node has {largest}",
            None,
        )
    planning = build_problem(
        session, config, _known_forecast(session, config, now), JobModels(), now
    )
    model = prior_job_model(request.workload, request.global_batch_size, allowed)
    assert request.deadline is not None
    new_job = JobSpec(
        job_id="new",
        allowed_gpus=allowed,
        throughput_samples_per_s=tuple(model.throughput_samples_per_s[g] for g in allowed),
        power_w=tuple(model.power_w[g] for g in allowed),
        remaining_samples=float(total_samples),
        deadline_s=(request.deadline - now).total_seconds(),
        priority=float(request.priority + 1),
        best_effort=request.best_effort,
    )
    # The same policy as the control loop: admission promises what the loop will then plan.
    return admit(
        planning.problem,
        new_job,
        time_limit_s=ADMISSION_TIME_LIMIT_S,
        seed=config.planner.seed,
        policy=get_policy(config.planner.policy),
    )
