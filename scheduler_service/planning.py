"""Turn the database's view of the cluster into an AllocationProblem, and a plan into a Plan row."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from energy_model.carbon.forecast import CarbonForecast
from energy_model.emissions import split_by_steps
from energy_model.job_model import JobModel, JobModelFitter, TelemetryPoint, prior_job_model
from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    BudgetMode,
    BudgetPeriod,
    InvalidProblem,
    JobSpec,
    allowed_gpu_counts,
)
from scheduler_service.db.models import Job, Plan
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import JobState
from scheduler_service.ledger import periods_for_horizon
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.settings import GreenflowConfig
from scheduler_service.telemetry.repository import TelemetryRepository
from scheduler_service.telemetry.service import total_samples_of

PLANNABLE_STATES = (JobState.QUEUED, JobState.DEFERRED, JobState.RUNNING, JobState.RESIZING)


@dataclass
class JobModels:
    """Per-job fitted models, refitted from new telemetry each tick (rebuilt from the DB on restart)."""

    fitters: dict[int, JobModelFitter] = field(default_factory=dict)
    last_sample_at: dict[int, datetime] = field(default_factory=dict)

    def model_for(self, session: Session, job: Job, allowed: tuple[int, ...]) -> JobModel:
        """The job's current model over `allowed` counts: prior, refitted with its telemetry."""
        fitter = self.fitters.get(job.id)
        if fitter is None or fitter.prior.allowed_gpus != allowed:
            fitter = JobModelFitter(prior_job_model(job.workload, job.global_batch_size, allowed))
            self.fitters[job.id] = fitter
            self.last_sample_at.pop(job.id, None)
        since = self.last_sample_at.get(job.id)
        new = [
            s
            for s in TelemetryRepository(session).for_job(
                job.id, since=since, limit=fitter.max_samples
            )
            if (since is None or s.at > since) and s.gpus > 0 and s.samples_per_s > 0
        ]
        if new:
            self.last_sample_at[job.id] = new[-1].at
            return fitter.update(
                TelemetryPoint(
                    gpus=s.gpus,
                    samples_per_s=s.samples_per_s,
                    power_w=s.power_w,
                    at=s.at,
                    layout=s.layout,
                )
                for s in new
            )
        return fitter.model

    def forget(self, keep_job_ids: set[int]) -> None:
        """Drop models of jobs no longer planned."""
        for job_id in set(self.fitters) - keep_job_ids:
            self.fitters.pop(job_id, None)
            self.last_sample_at.pop(job_id, None)


@dataclass(frozen=True)
class PlanningInput:
    """A problem plus what is needed to act on its plan."""

    problem: AllocationProblem
    jobs: dict[str, Job]
    models: dict[str, JobModel]
    unplaceable: dict[int, str]


def slot_intensities(
    forecast: CarbonForecast, start_at: datetime, slot_s: float, num_slots: int
) -> tuple[float, ...]:
    """Mean forecast intensity over each slot (exact step integration)."""
    out = []
    for t in range(num_slots):
        lo = start_at + timedelta(seconds=t * slot_s)
        hi = lo + timedelta(seconds=slot_s)
        parts = split_by_steps(max(lo, forecast.points[0].at), hi, forecast)
        total_s = sum(seconds for seconds, _ in parts)
        out.append(
            sum(seconds * value for seconds, value in parts) / total_s
            if total_s > 0
            else forecast.now_g_per_kwh
        )
    return tuple(out)


def build_problem(
    session: Session,
    config: GreenflowConfig,
    forecast: CarbonForecast,
    models: JobModels,
    now: datetime,
) -> PlanningInput:
    """The problem of this tick: plannable jobs, ready capacity, the forecast and the budget left."""
    slot_s = float(config.planner.slot_s)
    num_slots = max(1, int(config.planner.horizon_s // config.planner.slot_s))
    nodes = NodeRepository(session).nodes_with_slots(ready_only=True)
    capacity = sum(len(n.slots) for n in nodes)
    # A job runs inside one node (its process group does not span agents yet).
    largest_node = max((len(n.slots) for n in nodes), default=0)
    jobs: dict[str, Job] = {}
    specs: list[JobSpec] = []
    job_models: dict[str, JobModel] = {}
    unplaceable: dict[int, str] = {}
    for job in JobRepository(session).in_states([s.value for s in PLANNABLE_STATES]):
        if job.held or (job.begin_after is not None and job.begin_after > now):
            continue
        remaining = (
            total_samples_of(job.total_samples, job.total_steps, job.global_batch_size)
            - job.samples_done
        )
        if remaining <= 0:
            continue
        top = min(job.max_gpus, largest_node)
        try:
            allowed = allowed_gpu_counts(job.min_gpus, top)
        except InvalidProblem:
            unplaceable[job.id] = (
                f"needs at least {job.min_gpus} GPUs on one node; the largest ready node has {largest_node}"
            )
            continue
        model = models.model_for(session, job, allowed)
        key = str(job.id)
        jobs[key] = job
        job_models[key] = model
        specs.append(
            JobSpec(
                job_id=key,
                allowed_gpus=allowed,
                throughput_samples_per_s=tuple(model.throughput_samples_per_s[g] for g in allowed),
                power_w=tuple(model.power_w[g] for g in allowed),
                remaining_samples=float(remaining),
                deadline_s=(job.deadline_at - now).total_seconds() if job.deadline_at else None,
                priority=float(max(job.priority, 0) + 1),
                current_gpus=job.current_gpus if job.current_gpus in allowed else 0,
                best_effort=job.best_effort,
            )
        )
    models.forget({int(k) for k in jobs})
    horizon_end = now + timedelta(seconds=slot_s * num_slots)
    periods = tuple(
        BudgetPeriod(
            start_s=(p.start_at - now).total_seconds(),
            end_s=(p.end_at - now).total_seconds(),
            budget_left_kg=p.left_kg,
        )
        for p in periods_for_horizon(session, config, now, horizon_end)
    )
    problem = AllocationProblem(
        start_at=now,
        slot_s=slot_s,
        capacity_gpus=(capacity,) * num_slots,
        intensity_g_per_kwh=slot_intensities(forecast, now, slot_s, num_slots),
        jobs=tuple(specs),
        pue=config.cluster.pue,
        budget_periods=periods,
        budget_mode=BudgetMode(config.budget.enforcement),
        carbon_price_s_per_kg=config.budget.soft_price_s_per_kg
        if config.budget.enforcement == "soft"
        else 0.0,
    )
    return PlanningInput(problem, jobs, job_models, unplaceable)


def plan_row(plan: AllocationPlan, problem: AllocationProblem, degraded: bool) -> Plan:
    """The Plan row that records a solver result."""
    return Plan(
        start_at=plan.start_at,
        slot_s=plan.slot_s,
        policy=plan.policy,
        status=plan.status,
        gap=plan.gap,
        solve_s=plan.solve_s,
        energy_kwh=plan.energy_kwh,
        emissions_kg=plan.emissions_kg,
        forecast_degraded=degraded,
        gpus_by_job={job_id: list(counts) for job_id, counts in plan.gpus.items()},
        slots=[
            {
                "capacity_gpus": problem.capacity_gpus[t],
                "intensity_g_per_kwh": problem.intensity_g_per_kwh[t],
                "energy_kwh": plan.energy_kwh_per_slot[t],
                "emissions_kg": plan.emissions_kg_per_slot[t],
            }
            for t in range(problem.num_slots)
        ],
        deadline_misses=dict(plan.missed_reasons),
    )
