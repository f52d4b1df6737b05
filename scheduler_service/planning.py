"""Read the database's view of the cluster into a `ClusterSnapshot` (batched queries), build its
AllocationProblem with the one builder (`allocation/snapshot.py`), and turn a plan into a Plan row."""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from statistics import NormalDist

from sqlalchemy.orm import Session

from energy_model.carbon.forecast import CarbonForecast
from energy_model.carbon.series import IntensitySeries
from energy_model.emissions import StepSeries, split_by_steps
from energy_model.job_model import JobModel, JobModelFitter, TelemetryPoint, prior_job_model
from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    BudgetMode,
    InvalidProblem,
    allowed_gpu_counts,
)
from scheduler_service.allocation.snapshot import (
    BudgetWindow,
    ClusterSnapshot,
    PlannableJob,
    ProblemKnobs,
    TeamWindows,
    build_problem,
    most_gpus_per_job,
)
from scheduler_service.budget.ledger import (
    periods_for_horizon,
    spent_team_queues,
    team_periods_for_horizon,
)
from scheduler_service.db.models import Allocation, Job, Node, Plan
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.jobs.repository import JobRepository, PlanRow
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.placement import (
    LIVE_MOVABLE,
    NodeFacts,
    NodeSlots,
    Placement,
    job_placement,
    tp_degree,
)
from scheduler_service.settings import GreenflowConfig
from scheduler_service.telemetry.repository import TelemetryRepository
from scheduler_service.telemetry.service import total_samples_of

PLANNABLE_STATES = (JobState.QUEUED, JobState.DEFERRED, JobState.RUNNING, JobState.RESIZING)


@dataclass
class JobModels:
    """Per-job fitted models, refitted from new telemetry (rebuilt from the DB on restart).

    Telemetry is read for all planned jobs at once (`refresh`, in the snapshot's transaction):
    the newest samples of a job new to the models, and for the others the samples stored since
    the last read (by sample id; one committed out of id order by a concurrent writer may be
    skipped, and the fit has hundreds). The refits (`fitted`) run after that transaction, a job's
    at most once per `refit_interval_s` (a refit takes 8-12 ms: at every tick for every
    running job it would outgrow the solve); its new samples wait in the fitter's buffer.
    """

    refit_interval_s: float = 0.0
    max_refits: int | None = None
    # Deferred: `fitted` refits nothing and returns each job's current model; the refits due
    # are left to `refit_due`, which the control loop runs beside the solve (first fits of
    # hundreds of just-started jobs were most of a 1,000-job tick's work outside the solve).
    deferred: bool = False
    due: list[int] = field(default_factory=list)
    fitters: dict[int, JobModelFitter] = field(default_factory=dict)
    last_sample_id: dict[int, int] = field(default_factory=dict)
    # Every sample with an id up to this one was read for the jobs that had a model then.
    read_up_to_id: int = 0
    waiting: dict[int, list[TelemetryPoint]] = field(default_factory=dict)
    refit_at_s: dict[int, float] = field(default_factory=dict)
    refits: int = 0

    def refresh(self, session: Session, priors: dict[int, JobModel]) -> None:
        """Read the planned jobs' new telemetry (`priors`: job id -> its prior)."""
        fresh: list[int] = []
        for job_id, prior in priors.items():
            fitter = self.fitters.get(job_id)
            if fitter is None or fitter.prior.allowed_gpus != prior.allowed_gpus:
                self.fitters[job_id] = JobModelFitter(prior)
                self.last_sample_id.pop(job_id, None)
                self.waiting.pop(job_id, None)
                self.refit_at_s.pop(job_id, None)
                fresh.append(job_id)
        fresh_ids = set(fresh)  # once: built inside the comprehension it made this O(jobs^2)
        known = [job_id for job_id in priors if job_id not in fresh_ids]
        telemetry = TelemetryRepository(session)
        newest_id = telemetry.newest_id()
        rows = telemetry.of_jobs_after(known, self.read_up_to_id)
        if fresh:
            limit = max(self.fitters[j].max_samples for j in fresh)
            rows.update(telemetry.newest_of_jobs(fresh, limit=limit))
        self.read_up_to_id = max(self.read_up_to_id, newest_id)
        for job_id in priors:
            seen = self.last_sample_id.get(job_id, 0)
            new = [
                s
                for s in rows.get(job_id, ())
                if s.id > seen and s.gpus > 0 and s.samples_per_s > 0
            ]
            if not new:
                continue
            self.last_sample_id[job_id] = max(s.id for s in new)
            self.waiting.setdefault(job_id, []).extend(
                TelemetryPoint(
                    gpus=s.gpus,
                    samples_per_s=s.samples_per_s,
                    power_w=s.power_w,
                    at=s.at,
                    layout=s.layout,
                    power_source=s.power_source,
                )
                for s in new
            )

    def fitted(self, job_ids: Iterable[int]) -> dict[int, JobModel]:
        """Each job's model, refitted with its waiting samples where its refit is due (no I/O);
        at most `max_refits` refits a call, the longest waiting first (a restart with a
        thousand running jobs spreads their first refits over several ticks)."""
        now_s = time.monotonic()
        ids = list(job_ids)
        due = sorted(
            (
                job_id
                for job_id in ids
                if self.waiting.get(job_id)
                and now_s - self.refit_at_s.get(job_id, -math.inf) >= self.refit_interval_s
            ),
            key=lambda job_id: self.refit_at_s.get(job_id, -math.inf),
        )
        if self.deferred:
            self.due = due[: self.max_refits]
        else:
            self._refit(due[: self.max_refits], now_s)
        return {job_id: self.fitters[job_id].model for job_id in ids}

    def refit_due(self) -> int:
        """Run the refits the last `fitted` left due (deferred); how many ran. Not concurrently
        with `refresh`, `fitted` or `forget`: the caller finishes it before the next snapshot."""
        due, self.due = self.due, []
        self._refit(due, time.monotonic())
        return len(due)

    def _refit(self, job_ids: list[int], now_s: float) -> None:
        for job_id in job_ids:
            waiting = self.waiting.pop(job_id, None)
            if not waiting:
                continue
            self.fitters[job_id].update(waiting)
            self.refits += 1
            self.refit_at_s[job_id] = now_s

    def forget(self, keep_job_ids: set[int]) -> None:
        """Drop models of jobs no longer planned."""
        for job_id in set(self.fitters) - keep_job_ids:
            self.fitters.pop(job_id, None)
            self.last_sample_id.pop(job_id, None)
            self.waiting.pop(job_id, None)
            self.refit_at_s.pop(job_id, None)


def plan_facts(job: Job | PlanRow) -> tuple[object, ...]:
    """What of a job its plan depends on (not its progress, which telemetry moves all the time)."""
    return (
        job.state,
        job.held,
        job.priority,
        job.deadline_at,
        job.begin_after,
        job.min_gpus,
        job.max_gpus,
        job.best_effort,
    )


@dataclass(frozen=True)
class PlannedJob:
    """What acting on a plan needs of a planned job, as the snapshot read it."""

    job_id: int
    version: int  # the row's version when read
    priority: int
    deadline_at: datetime | None
    facts: tuple[object, ...] = ()  # `plan_facts` when read: a change there means plan again


@dataclass(frozen=True)
class PlanningInput:
    """A snapshot, its problem, and what is needed to act on its plan."""

    snapshot: ClusterSnapshot
    problem: AllocationProblem
    jobs: dict[str, PlannedJob]
    models: dict[str, JobModel]
    unplaceable: dict[int, str]
    # The ready nodes as the loop places jobs on them: admission places its plan on them too.
    nodes: NodeFacts = field(default_factory=NodeFacts)


def slot_intensities(
    forecast: StepSeries, start_at: datetime, slot_s: float, num_slots: int
) -> tuple[float, ...]:
    """Mean intensity of a step series (a forecast) over each slot (exact step integration)."""
    out = []
    first_at, now_value = forecast.times[0], forecast.intensity_g_per_kwh[0]
    for t in range(num_slots):
        lo = start_at + timedelta(seconds=t * slot_s)
        hi = lo + timedelta(seconds=slot_s)
        parts = split_by_steps(max(lo, first_at), hi, forecast)
        total_s = sum(seconds for seconds, _ in parts)
        out.append(
            sum(seconds * value for seconds, value in parts) / total_s if total_s > 0 else now_value
        )
    return tuple(out)


def plans_hard_budget(config: GreenflowConfig) -> bool:
    """Whether a plan is held to a hard budget: the cluster's or any team's."""
    budget = config.budget
    return budget.enforcement == "hard" or any(
        team.enforcement == "hard" for team in budget.teams.values()
    )


def planning_series(forecast: CarbonForecast, config: GreenflowConfig) -> StepSeries:
    """The intensity a plan is made with: under a hard budget the forecast's upper quantile
    (`carbon.forecast_quantile` of the measured forecast error per horizon hour, so the budget
    holds when the forecast is wrong; bench/budget_uncertainty.py), else the forecast itself."""
    return forecast.upper_series() if plans_hard_budget(config) else forecast


def commit_series(forecast: CarbonForecast, quantile: float) -> StepSeries:
    """The forecast's upper values re-scaled from its `upper_quantile` to `quantile` (a normal
    spread of the log error, as `energy_model.carbon.skill` scales its prior): what the slot about
    to run is planned with under a hard budget. Measured points stay their value."""
    upper = forecast.upper_series()
    base = forecast.upper_quantile
    if base is None or base <= 0.5 or quantile <= base:
        return upper
    ratio = NormalDist().inv_cdf(quantile) / NormalDist().inv_cdf(base)
    values = tuple(
        value if value <= 0 or high <= value else value * (high / value) ** ratio
        for value, high in zip(forecast.intensity_g_per_kwh, upper.intensity_g_per_kwh, strict=True)
    )
    return IntensitySeries(forecast.times, values, source=f"{upper.source} (commit q{quantile:g})")


def planned_intensities(
    forecast: CarbonForecast, config: GreenflowConfig, now: datetime, slot_s: float, num_slots: int
) -> tuple[float, ...]:
    """Mean planned intensity per slot (`planning_series`); under a hard budget the slot about to
    run at `budget.commit_quantile` (`commit_series`): its spend is committed before the next plan
    can correct it, while later slots are planned again once their hour is measured."""
    out = slot_intensities(planning_series(forecast, config), now, slot_s, num_slots)
    if not plans_hard_budget(config):
        return out
    first = slot_intensities(commit_series(forecast, config.budget.commit_quantile), now, slot_s, 1)
    return (max(out[0], first[0]), *out[1:])


def live_knobs(config: GreenflowConfig) -> ProblemKnobs:
    """The builder's knobs of the live service (the simulator's come from its own config).

    No deadline margin and the least change cost: the service has no measured switch stall to
    charge yet (the simulator charges its `switch_s`).
    """
    return ProblemKnobs(
        budget_mode=BudgetMode(config.budget.enforcement),
        carbon_price_s_per_kg=config.budget.soft_price_s_per_kg
        if config.budget.enforcement == "soft"
        else 0.0,
    )


@dataclass(frozen=True)
class SnapshotRows:
    """What the snapshot's transaction read: the rest of the snapshot needs no database."""

    now: datetime
    node_gpus: tuple[int, ...]
    # (job's row, allowed GPU counts, samples left) per plannable job: plain rows, no ORM objects.
    chosen: tuple[tuple[PlanRow, tuple[int, ...], int], ...]
    unplaceable: dict[int, str]
    windows: tuple[BudgetWindow, ...]
    # Queues of teams whose soft budget is spent: their jobs are planned at the lowest priority.
    deprioritised: frozenset[str] = frozenset()
    # Per team with a hard budget: its queues and what it has left per period of the horizon.
    team_windows: tuple[tuple[str, frozenset[str], tuple[BudgetWindow, ...]], ...] = ()
    # GPUs of each ready node whose agent advertised an address the others reach.
    spannable_gpus: tuple[int, ...] = ()
    nodes: NodeFacts = field(default_factory=NodeFacts)


def read_snapshot(
    session: Session,
    config: GreenflowConfig,
    forecast: CarbonForecast,
    models: JobModels,
    now: datetime,
) -> PlanningInput:
    """This tick's snapshot (ready capacity, plannable jobs with models, forecast, budget left)
    read with a fixed number of queries, and the problem `build_problem` makes of it."""
    return assemble_snapshot(read_rows(session, config, models, now), config, forecast, models)


def read_rows(
    session: Session, config: GreenflowConfig, models: JobModels, now: datetime
) -> SnapshotRows:
    """The snapshot's reads, in a fixed number of queries (the telemetry goes to `models`)."""
    slot_s = float(config.planner.slot_s)
    num_slots = max(1, int(config.planner.horizon_s // config.planner.slot_s))
    nodes = NodeRepository(session).nodes_with_slots(ready_only=True)
    node_gpus = tuple(len(n.slots) for n in nodes)
    # A job runs inside one node, or across the nodes whose agents reach each other (they
    # advertised a rendezvous address): then it may use all of theirs together.
    spannable = tuple(len(n.slots) for n in nodes if n.rendezvous_host and n.worker_host_port)
    largest_node = most_gpus_per_job(node_gpus, spannable)
    unplaceable: dict[int, str] = {}
    chosen: list[tuple[PlanRow, tuple[int, ...], int]] = []
    # Queues whose team's hard budget is spent wait for the next period; a spent soft one's
    # jobs are planned at the lowest priority.
    spent = spent_team_queues(session, config, now)
    over_budget, deprioritised = spent["hard"], spent["soft"]
    for job in JobRepository(session).plan_rows_in_states([s.value for s in PLANNABLE_STATES]):
        if (
            job.held
            or job.queue in over_budget
            or (job.begin_after is not None and job.begin_after > now)
        ):
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
                f"needs at least {job.min_gpus} GPUs; a job gets at most {largest_node} (the "
                "largest ready node, or all nodes a job may span together)"
            )
            continue
        chosen.append((job, allowed, remaining))
    # Jobs of one workload, batch and GPU range share one prior: after a burst of 5,000
    # submissions building each job's own was 0.2 s of the snapshot's transaction.
    built: dict[tuple[str, int, tuple[int, ...]], JobModel] = {}
    priors = {
        job.id: _prior(models, job.id, job.workload, job.global_batch_size, allowed, built)
        for job, allowed, _ in chosen
    }
    models.refresh(session, priors)
    models.forget(set(priors))
    horizon_end = now + timedelta(seconds=slot_s * num_slots)
    windows = tuple(
        BudgetWindow(
            start_s=(p.start_at - now).total_seconds(),
            end_s=(p.end_at - now).total_seconds(),
            budget_kg=p.left_kg,
        )
        for p in periods_for_horizon(session, config, now, horizon_end)
    )
    team_windows = tuple(
        (
            team,
            frozenset(config.budget.teams[team].queues),
            tuple(
                BudgetWindow(
                    start_s=(p.start_at - now).total_seconds(),
                    end_s=(p.end_at - now).total_seconds(),
                    budget_kg=p.left_kg,
                )
                for p in statuses
            ),
        )
        for team, statuses in team_periods_for_horizon(session, config, now, horizon_end).items()
    )
    return SnapshotRows(
        now,
        node_gpus,
        tuple(chosen),
        unplaceable,
        windows,
        frozenset(deprioritised),
        team_windows,
        spannable,
        _node_facts(
            session, nodes, chosen, now, span_fresh_s(config), config.cluster.checkpoints_shared
        ),
    )


def _node_facts(
    session: Session,
    nodes: Sequence[Node],
    chosen: Sequence[tuple[PlanRow, tuple[int, ...], int]],
    now: datetime,
    fresh_s: float,
    move_running: bool,
) -> NodeFacts:
    """The ready nodes (already read) as the loop's placement sees them (`node_facts`); the
    planned jobs' newest commands in one query (none without a ready node)."""
    by_job: dict[int, dict[int, list[int]]] = {}
    for node in nodes:
        for slot in node.slots:
            if slot.job_id is not None:
                by_job.setdefault(slot.job_id, {}).setdefault(node.id, []).append(slot.index)
    # A queued job that holds no slots has no home node to go back to (a queued job was never
    # paused, or was re-queued after its node was lost): no command of it is read.
    ids = [
        job.id
        for job, _, _ in chosen
        if nodes and (job.id in by_job or JobState(job.state) is not JobState.QUEUED)
    ]
    newest, newest_acked = AllocationRepository(session).newest_and_newest_acked(ids)
    current = {
        job_id: job_placement(parts, last.node_id if (last := newest.get(job_id)) else None)
        for job_id, parts in by_job.items()
    }
    return node_facts(
        nodes,
        current,
        newest_acked,
        {job.id: d for job, _, _ in chosen if (d := tp_degree(job.current_layout)) > 1},
        spannable_nodes(nodes, now, fresh_s),
        {job.id for job, _, _ in chosen},
        move_running,
    )


def node_facts(
    nodes: Sequence[Node],
    current: Mapping[int, Placement],
    newest_acked: Mapping[int, Allocation],
    tp: Mapping[int, int],
    spannable: Collection[int],
    planned: Collection[int],
    move_running: bool,
) -> NodeFacts:
    """What placement works on, as the loop (`dispatch.decide`) and admission (the snapshot)
    both build it: the ready nodes' slots, where jobs hold slots (`current`), the home node of
    every paused job (`pause_homes`) and the jobs' tensor-parallel degrees.

    Slots held by a job the plan leaves out (`planned`: the jobs it plans) are no slots to
    place on: placement frees only the slots of jobs it places (a held job still running, say,
    keeps its own until something stops it). `move_running`: running jobs may move to another
    node (`[cluster] checkpoints_shared`); else only jobs holding no slots are placed elsewhere."""
    keep = set(planned)
    return NodeFacts(
        nodes=tuple(
            NodeSlots(n.id, tuple(s.index for s in n.slots if s.job_id is None or s.job_id in keep))
            for n in nodes
        ),
        spannable=frozenset(spannable),
        current=current,
        tp=tp,
        homes=pause_homes(newest_acked, current),
        movable=LIVE_MOVABLE if move_running else frozenset(),
    )


def pause_homes(
    newest_acked: Mapping[int, Allocation], current: Mapping[int, Placement]
) -> dict[int, int]:
    """Node of each paused job's acknowledged pause (for jobs holding no slots): its agent holds
    the job's state in memory."""
    return {
        job_id: last.node_id
        for job_id, last in newest_acked.items()
        if job_id not in current and last.gpus == 0 and last.node_id is not None
    }


def span_fresh_s(config: GreenflowConfig) -> float:
    """How recently a node must have been heard from for a job to span onto it: three heartbeat
    intervals (a node that just died under a spanning job is not chosen again while its
    heartbeats time out)."""
    return 3 * config.cluster.agent_heartbeat_interval_s


def spannable_nodes(nodes: Iterable[Node], now: datetime, fresh_s: float | None) -> frozenset[int]:
    """The ready nodes a job may span: their agents advertised an address the others reach, and
    (`fresh_s`) were heard from this recently, and for that long since a job's runner last
    reported their workers lost (a node that just died is not chosen again while it is still
    heard from recently enough)."""
    return frozenset(
        n.id
        for n in nodes
        if n.rendezvous_host
        and n.worker_host_port
        and (fresh_s is None or heard_within(n, now, fresh_s))
        and not _reported_lost_since(n, fresh_s or 0.0)
    )


def _reported_lost_since(node: Node, fresh_s: float) -> bool:
    """Whether a runner reported the node's workers lost less than `fresh_s` before the node's
    last heartbeat (or after it)."""
    reported, last = node.lost_reported_at, node.last_heartbeat_at
    if reported is None:
        return False
    if last is None:
        return True
    # SQLite hands back naive UTC.
    reported = reported if reported.tzinfo else reported.replace(tzinfo=UTC)
    last = last if last.tzinfo else last.replace(tzinfo=UTC)
    return (last - reported).total_seconds() < fresh_s


def heard_within(node: Node, now: datetime, seconds: float) -> bool:
    """Whether the node's last heartbeat is at most `seconds` before `now`."""
    last = node.last_heartbeat_at
    if last is None:
        return False
    if last.tzinfo is None:  # SQLite hands back naive UTC
        last = last.replace(tzinfo=UTC)
    return (now - last).total_seconds() <= seconds


def assemble_snapshot(
    rows: SnapshotRows, config: GreenflowConfig, forecast: CarbonForecast, models: JobModels
) -> PlanningInput:
    """The snapshot and its problem from what `read_rows` read (refits, no database)."""
    now = rows.now
    slot_s = float(config.planner.slot_s)
    num_slots = max(1, int(config.planner.horizon_s // config.planner.slot_s))
    fitted = models.fitted(job.id for job, _, _ in rows.chosen)
    plannable: list[PlannableJob] = []
    jobs: dict[str, PlannedJob] = {}
    job_models: dict[str, JobModel] = {}
    for job, allowed, remaining in rows.chosen:
        model = fitted[job.id]
        key = str(job.id)
        jobs[key] = PlannedJob(job.id, job.version, job.priority, job.deadline_at, plan_facts(job))
        job_models[key] = model
        plannable.append(
            PlannableJob(
                job_id=key,
                allowed_gpus=allowed,
                throughput_samples_per_s=tuple(model.throughput_samples_per_s[g] for g in allowed),
                power_w=tuple(model.power_w[g] for g in allowed),
                remaining_samples=float(remaining),
                deadline_s=(job.deadline_at - now).total_seconds() if job.deadline_at else None,
                priority=0 if job.queue in rows.deprioritised else job.priority,
                current_gpus=job.current_gpus,
                best_effort=job.best_effort,
            )
        )
    snapshot = ClusterSnapshot(
        start_at=now,
        slot_s=slot_s,
        num_slots=num_slots,
        node_gpus=rows.node_gpus,
        spannable_gpus=rows.spannable_gpus,
        intensity_g_per_kwh=planned_intensities(forecast, config, now, slot_s, num_slots),
        jobs=tuple(plannable),
        budget_windows=rows.windows,
        pue=config.cluster.pue,
        team_budgets=tuple(
            TeamWindows(
                team=team,
                job_ids=frozenset(str(job.id) for job, _, _ in rows.chosen if job.queue in queues),
                windows=windows,
            )
            for team, queues, windows in rows.team_windows
        ),
    )
    problem = build_problem(snapshot, live_knobs(config))
    return PlanningInput(snapshot, problem, jobs, job_models, rows.unplaceable, rows.nodes)


def _prior(
    models: JobModels,
    job_id: int,
    workload: str,
    batch: int,
    allowed: tuple[int, ...],
    built: dict[tuple[str, int, tuple[int, ...]], JobModel],
) -> JobModel:
    """The job's prior over `allowed`: the fitter's own when its counts still hold (no rebuild),
    else the one in `built` for its workload, batch and counts (a prior is never changed: a
    fitter's refits make new models), built there if missing."""
    fitter = models.fitters.get(job_id)
    if fitter is not None and fitter.prior.allowed_gpus == allowed:
        return fitter.prior
    key = (workload, batch, allowed)
    if key not in built:
        built[key] = prior_job_model(workload, batch, allowed)
    return built[key]


def plan_row(plan: AllocationPlan, problem: AllocationProblem, degraded: bool) -> Plan:
    """The Plan row that records a solver result (without its per-job rows: `add_plan` stores
    `plan.gpus` and `plan.missed_reasons` as those)."""
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
        slots=[
            {
                "capacity_gpus": problem.capacity_gpus[t],
                "intensity_g_per_kwh": problem.intensity_g_per_kwh[t],
                "energy_kwh": plan.energy_kwh_per_slot[t],
                "emissions_kg": plan.emissions_kg_per_slot[t],
            }
            for t in range(problem.num_slots)
        ],
    )
