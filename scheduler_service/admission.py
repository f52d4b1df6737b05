"""Admission at submission (ElasticFlow semantics): a deadline is accepted only if a plan meets it."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from energy_model.carbon.forecast import CarbonForecast, ForecastPoint, PointKind, Signal
from energy_model.job_model import JobModel, JobModelFitter, prior_job_model
from scheduler_service.allocation.admission import (
    AdmissionDecision,
    HeldGpus,
    admit,
    admit_on_spare,
    in_force_plan,
    refused,
    team_budget_refusal,
    unlisted_load,
    without_held,
)
from scheduler_service.allocation.policies import get_policy
from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    InvalidProblem,
    JobSpec,
    allowed_gpu_counts,
)
from scheduler_service.allocation.snapshot import PlannableJob, plan_job
from scheduler_service.carbon.repository import CarbonRepository
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import CarbonForecastRecord
from scheduler_service.dispatch.plans import plan_contents
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.jobs.schemas import JobSpec as JobRequest
from scheduler_service.placement import lost_once_placed
from scheduler_service.planning import JobModels, PlanningInput, live_knobs, read_snapshot
from scheduler_service.settings import GreenflowConfig

ADMISSION_TIME_LIMIT_S = 2.0
# A promise whose job no snapshot lists this long after it was made is dropped: the job is gone
# (finished, cancelled) or its submission never committed.
RESERVATION_GRACE_S = 300.0
# Checks within this many seconds of a snapshot read reuse it (a burst reads it once).
SNAPSHOT_REUSE_S = 5.0

log = logging.getLogger("greenflow.admission")


def _known_forecast(
    session: Session,
    config: GreenflowConfig,
    now: datetime,
    record: CarbonForecastRecord | None = None,
) -> CarbonForecast:
    """The newest stored forecast (`record`, when read already), or the conservative intensity
    when none was fetched yet."""
    record = record or CarbonRepository(session).latest_forecast()
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
    """Whether a job with a deadline can be admitted without breaking admitted jobs' deadlines
    (a full solve with fresh models; `Admission.check` is the service's incremental one)."""
    return Admission(config).check(session, request, total_samples, now).decision


@dataclass
class BorrowedModels(JobModels):
    """Admission's job models when the control loop runs in this process: the loop's latest
    fit of each job (its `JobModels`), else the job's prior; no telemetry read and no refit on a
    request's path (a first snapshot read refitting hundreds of jobs took 7-9 s at load 20)."""

    loop_models: JobModels | None = None

    def refresh(self, session: Session, priors: dict[int, JobModel]) -> None:
        """Keep each planned job's prior (the loop reads the telemetry and refits)."""
        for job_id, prior in priors.items():
            fitter = self.fitters.get(job_id)
            if fitter is None or fitter.prior.allowed_gpus != prior.allowed_gpus:
                self.fitters[job_id] = JobModelFitter(prior)

    def fitted(self, job_ids: Iterable[int]) -> dict[int, JobModel]:
        """The loop's current model of each job where it fits the same counts, else the prior."""
        loop = self.loop_models.fitters if self.loop_models is not None else {}
        out = {}
        for job_id in job_ids:
            own = self.fitters[job_id]
            theirs = loop.get(job_id)
            same = theirs is not None and theirs.prior.allowed_gpus == own.prior.allowed_gpus
            out[job_id] = theirs.model if same and theirs is not None else own.model
        return out


@dataclass(frozen=True)
class AdmissionResult:
    """A decision, what the new job was promised (its counts from the problem's start), and the
    key its promise is held under until `Admission.bind` or `Admission.withdraw`."""

    decision: AdmissionDecision
    held: HeldGpus | None = None
    key: str | None = None


@dataclass
class AdmissionStats:
    """What admission did, for tests and metrics: checks, the full solves among them, and the
    most checks that ever ran at once (one: a burst queues, it does not solve in parallel)."""

    checks: int = 0
    solves: int = 0
    snapshots: int = 0  # snapshot reads (a burst's checks share one)
    most_at_once: int = 0


class Admission:
    """Admission in one scheduler process: one check at a time, incremental where it can be.

    A new deadline is checked first against the plan in force and the promises made since
    (`allocation.admission.admit_on_spare`: the GPUs and budgets they leave, no other job
    moved); only when that cannot tell is the whole problem solved with the loop's policy
    (`admit`), on what the promises of jobs the snapshot does not list yet leave. The reads (the
    forecast, the snapshot) come before the check's turn; the check itself runs behind one lock
    and holds an admitted job's promise in process memory before the turn ends, under a
    provisional key until the job is stored (`bind`) or not (`withdraw`). So a burst queues
    instead of solving in parallel, each check sees every promise before it, committed or not,
    and the job's INSERT and commit run outside the turn. Job models are kept between checks
    (refitted from new telemetry only, as the loop's are).
    """

    def __init__(
        self,
        config: GreenflowConfig,
        plan_in_force: Callable[[], AllocationPlan | None] | None = None,
        loop_models: JobModels | None = None,
    ) -> None:
        self.config = config
        # The loop's plan when it runs in this process (else the newest stored plan is read).
        self.plan_in_force = plan_in_force
        # With the loop in this process its models are borrowed; else admission refits its own,
        # at most as many a read as the loop does a tick.
        self.models: JobModels = (
            BorrowedModels(loop_models=loop_models)
            if loop_models is not None
            else JobModels(
                refit_interval_s=config.planner.model_refit_interval_s,
                max_refits=config.planner.model_refits_per_tick,
            )
        )
        self.stats = AdmissionStats()
        self._lock = threading.Lock()  # the check's turn
        self._snapshot_lock = threading.Lock()  # one snapshot read (and model refit) at a time
        self._reserved_lock = threading.Lock()  # the promises, changed outside the turn too
        self._running = 0
        # Job id (or provisional key) -> what it was promised, until a plan made after the
        # promise is in force.
        self._reserved: dict[str, HeldGpus] = {}
        self._reserved_at: dict[str, float] = {}  # key -> time.monotonic() of the promise
        self._keys = itertools.count(1)
        self._snapshot_cache: tuple[float, PlanningInput] | None = None
        self._forecast_cache: tuple[tuple[int, datetime], CarbonForecast] | None = None
        self._in_force_cache: tuple[AllocationPlan, HeldGpus] | None = None
        self.snapshot_reuse_s = SNAPSHOT_REUSE_S

    def check(
        self, session: Session, request: JobRequest, total_samples: int, now: datetime
    ) -> AdmissionResult:
        """Whether a job with a deadline can be admitted without breaking admitted deadlines;
        an admitted job's promise is held (`AdmissionResult.key`) until `bind` or `withdraw`."""
        began = time.perf_counter()
        solves = self.stats.solves
        forecast = self._forecast(session, now)
        planning, reused = self._planning(session, forecast, now)
        with self._lock:
            self.stats.checks += 1
            self._running += 1
            self.stats.most_at_once = max(self.stats.most_at_once, self._running)
            # The request's time was taken before it waited for its turn: check from now (the
            # plan in force and the promises before it may start later than the request did).
            now = max(now, utcnow())
            try:
                result = self._check(session, request, total_samples, now, forecast, planning)
                if reused and result is None:
                    # The burst's snapshot could not tell: try once more on a fresh one.
                    planning, _ = self._planning(session, forecast, now, fresh=True)
                    result = self._check(session, request, total_samples, now, forecast, planning)
                if result is None:
                    result = self._solve(session, request, total_samples, now, planning)
                return self._hold(result)
            finally:
                self._running -= 1
                log.info(
                    "admission check in %.3f s (%s)",
                    time.perf_counter() - began,
                    "full solve" if self.stats.solves > solves else "on the plan in force",
                )

    def bind(self, job_id: int, result: AdmissionResult) -> None:
        """Hold the promise made under `result.key` for the stored job `job_id` from now on."""
        if result.key is None:
            return
        with self._reserved_lock:
            held = self._reserved.pop(result.key, None)
            self._reserved_at.pop(result.key, None)
            if held is None:
                return
            self._reserved[str(job_id)] = _rekeyed(held, result.key, str(job_id))
            self._reserved_at[str(job_id)] = time.monotonic()

    def forget(self, job_id: int) -> None:
        """Drop the promise held for `job_id` (its submission was rolled back)."""
        with self._reserved_lock:
            self._reserved.pop(str(job_id), None)
            self._reserved_at.pop(str(job_id), None)

    def withdraw(self, result: AdmissionResult) -> None:
        """Drop the promise made under `result.key` (its job was not stored)."""
        if result.key is None:
            return
        with self._reserved_lock:
            self._reserved.pop(result.key, None)
            self._reserved_at.pop(result.key, None)

    def _hold(self, result: AdmissionResult) -> AdmissionResult:
        """Hold an admitted job's promise under a provisional key (in the check's turn, so the
        next check counts it while the job's submission commits)."""
        held = result.held
        if held is None or not result.decision.admitted or "new" not in held.gpus:
            return result
        key = f"pending-{next(self._keys)}"
        with self._reserved_lock:
            self._reserved[key] = _rekeyed(held, "new", key)
            self._reserved_at[key] = time.monotonic()
        return AdmissionResult(result.decision, held, key)

    def _team(self, request: JobRequest) -> str | None:
        """The team whose budget the request's queue draws on (None: none)."""
        return self.config.budget.team_of(request.queue)

    def _allowed(
        self, planning: PlanningInput, request: JobRequest
    ) -> tuple[int, ...] | AdmissionResult:
        """The job's allowed GPU counts on this cluster, or the rejection saying why none."""
        # As the loop plans (`read_rows`): a job may span the nodes whose agents reach each other.
        largest = planning.snapshot.job_gpus_max
        if largest == 0:
            return AdmissionResult(
                AdmissionDecision(False, False, "no GPUs are registered with the scheduler", None)
            )
        try:
            return allowed_gpu_counts(request.min_gpus, min(request.max_gpus, largest))
        except InvalidProblem:
            return AdmissionResult(
                AdmissionDecision(
                    False,
                    False,
                    f"needs at least {request.min_gpus} GPUs; a job gets at most {largest} (the "
                    "largest ready node, or all nodes a job may span together)",
                    None,
                )
            )

    def _check(
        self,
        session: Session,
        request: JobRequest,
        total_samples: int,
        now: datetime,
        forecast: CarbonForecast,
        planning: PlanningInput,
    ) -> AdmissionResult | None:
        """The incremental check on this snapshot (None: it cannot tell)."""
        allowed = self._allowed(planning, request)
        if isinstance(allowed, AdmissionResult):
            return allowed
        in_force = self._in_force(session)
        problem = planning.problem
        listed = {job.job_id for job in problem.jobs}
        stale = time.monotonic() - RESERVATION_GRACE_S
        # A promise no snapshot lists for a while is of a job that is gone.
        self._keep_reserved(lambda k: k in listed or self._reserved_at.get(k, 0.0) > stale)
        new_job = self._new_job(planning, request, total_samples, allowed, now)
        team = self._team(request)
        # A job its team's hard budget cannot pay for even alone: no plan would run it.
        if team is not None and (short := team_budget_refusal(problem, new_job, team)):
            return AdmissionResult(refused(new_job, short))
        promises = self._promises()
        fast = admit_on_spare(problem, new_job, in_force, promises, team=team)
        if fast is None:
            return None
        if fast[0].guaranteed and not planning.nodes.pooled():
            # The check pools the GPUs the plan leaves: it tells only where placement holds the
            # deadline jobs' rows and the new job's (jobs without a deadline yield), else the
            # solve's plan is placed (`placement.lost_once_placed`).
            assert in_force is not None
            rows: dict[str, tuple[int, ...]] = {"new": fast[1].over(problem, "new") or ()}
            for job in problem.jobs:
                # Each deadline job's row: the newest promise's, else the plan's (as the check).
                for h in (*reversed(promises), in_force):
                    row = h.over(problem, job.job_id) if job.deadline_s is not None else None
                    if row is not None:
                        rows[job.job_id] = row
                        break
            placed = _placer(planning, (*problem.jobs, new_job), request, promises, problem)
            if placed(rows) != rows:
                return None
        return AdmissionResult(*fast)

    def _solve(
        self,
        session: Session,
        request: JobRequest,
        total_samples: int,
        now: datetime,
        planning: PlanningInput,
    ) -> AdmissionResult:
        """The full check: the loop's policy on the snapshot's problem with the new job, on
        what the promises of jobs the snapshot does not list yet (committing) leave, started
        from the plan in force and the promises since (`in_force_plan`)."""
        config = self.config
        allowed = self._allowed(planning, request)
        if isinstance(allowed, AdmissionResult):
            return allowed
        new_job = self._new_job(planning, request, total_samples, allowed, now)
        promises = self._promises()
        problem = without_held(planning.problem, unlisted_load(planning.problem, promises))
        # The solve starts from the plan in force (and the promises since), moved to now: its
        # deadlines are the ones to keep, and a cold start can lose some it meets.
        in_force = self._in_force(session)
        previous = None if in_force is None else in_force_plan(problem, (in_force, *promises))
        # The same policy as the control loop: admission promises what the loop will then plan.
        self.stats.solves += 1
        # Solve outside the request's transaction: everything it needs is read, nothing is
        # written yet (the job is stored after the decision), so ending the read transaction
        # frees its connection and snapshot for the seconds the solve takes.
        if not (session.new or session.dirty or session.deleted):
            session.commit()
        decision = admit(
            problem,
            new_job,
            time_limit_s=ADMISSION_TIME_LIMIT_S,
            seed=config.planner.seed,
            policy=get_policy(config.planner.policy),
            previous=previous,
            team=self._team(request),
        )
        if decision.guaranteed and decision.plan is not None and not planning.nodes.pooled():
            trial = replace(problem, jobs=(*problem.jobs, new_job))
            placed = _placer(planning, trial.jobs, request, self._promises(), problem)
            lost = lost_once_placed(trial, decision.plan, {"new"}, placed)
            if lost:
                names = ", ".join("this job" if k == "new" else f"job {k}" for k in lost[:5])
                decision = refused(
                    new_job,
                    "the plan cannot be placed on the cluster's nodes: placed slot by slot (a job"
                    " spans only nodes whose agents advertised a rendezvous address, and its"
                    f" tensor-parallel groups stay inside a node) it misses the deadline of {names}",
                    decision.plan,
                )
        held = None
        if decision.plan is not None and "new" in decision.plan.gpus:
            watts = dict(zip(new_job.allowed_gpus, new_job.power_w, strict=True))
            team = self._team(request)
            held = HeldGpus(
                problem.start_at,
                problem.slot_s,
                {"new": decision.plan.gpus["new"]},
                {"new": {0: 0.0, **watts}},
                {"new": team} if team is not None else {},
            )
        return AdmissionResult(decision, held)

    def _forecast(self, session: Session, now: datetime) -> CarbonForecast:
        """`_known_forecast`, its points parsed once per stored forecast."""
        record = CarbonRepository(session).latest_forecast()
        if record is None:
            return _known_forecast(session, self.config, now)
        key = (record.id, record.fetched_at)
        cached = self._forecast_cache
        if cached is not None and cached[0] == key and cached[1].points[0].at <= now:
            return cached[1]
        forecast = _known_forecast(session, self.config, now, record)
        self._forecast_cache = (key, forecast)
        return forecast

    def _planning(
        self, session: Session, forecast: CarbonForecast, now: datetime, *, fresh: bool = False
    ) -> tuple[PlanningInput, bool]:
        """The snapshot to check on, and whether it is one reused from a check just before.

        A burst's checks share one snapshot for `SNAPSHOT_REUSE_S`: reading 1,000 queued jobs
        and their models is most of a check, and what changed since is covered, for the
        incremental check, by the promises made since (reserved) and the plan in force (read
        anew each time); jobs that finished since only leave more room. Read before the check's
        turn, one read at a time (the models are refitted in it).
        """
        with self._snapshot_lock:
            # From when the lock is had: a snapshot another check read meanwhile is not newer.
            now = max(now, utcnow())
            cached = self._snapshot_cache
            if (
                not fresh
                and cached is not None
                and time.monotonic() - cached[0] <= self.snapshot_reuse_s
                and cached[1].problem.start_at <= now
            ):
                return cached[1], True
            planning = read_snapshot(session, self.config, forecast, self.models, now)
            self.stats.snapshots += 1
            self._snapshot_cache = (time.monotonic(), planning)
            return planning, False

    def _new_job(
        self,
        planning: PlanningInput,
        request: JobRequest,
        total_samples: int,
        allowed: tuple[int, ...],
        now: datetime,
    ) -> JobSpec:
        """The new job as the snapshot's problem sees it (from the problem's start: the time
        since counts against it, as work at its fastest rate)."""
        model = prior_job_model(request.workload, request.global_batch_size, allowed)
        assert request.deadline is not None
        start_at = planning.problem.start_at
        rates = tuple(model.throughput_samples_per_s[g] for g in allowed)
        gone_s = max(0.0, (now - start_at).total_seconds())
        return plan_job(
            PlannableJob(
                job_id="new",
                allowed_gpus=allowed,
                throughput_samples_per_s=rates,
                power_w=tuple(model.power_w[g] for g in allowed),
                remaining_samples=float(total_samples) + max(rates) * gone_s,
                deadline_s=(request.deadline - start_at).total_seconds(),
                priority=request.priority,
                best_effort=request.best_effort,
            ),
            live_knobs(self.config),
        )

    def _promises(self) -> tuple[HeldGpus, ...]:
        """The promises held now (those of stored jobs and of jobs still committing)."""
        with self._reserved_lock:
            return tuple(self._reserved.values())

    def _in_force(self, session: Session) -> HeldGpus | None:
        """The plan in force (its rows built once per plan), and the reservations still to
        count on top of it."""
        plan = self.plan_in_force() if self.plan_in_force is not None else None
        held: HeldGpus | None
        if plan is not None:
            cached = self._in_force_cache
            if cached is not None and cached[0] is plan:
                held = cached[1]
            else:
                held = HeldGpus(plan.start_at, plan.slot_s, dict(plan.gpus))
                self._in_force_cache = (plan, held)
        else:
            repo = AllocationRepository(session)
            row = repo.latest_plan_header()
            held = None
            if row is not None:
                counts, _ = plan_contents(repo.plan_jobs(row.id), row.num_slots)
                held = HeldGpus(
                    _aware(row.start_at), row.slot_s, {k: tuple(v) for k, v in counts.items()}
                )
        if held is not None:
            # Kept until a plan in force has the promised job in it: a plan that starts after
            # the promise may come from a snapshot read before the job committed.
            gpus = held.gpus
            self._keep_reserved(lambda k: k not in gpus)
        return held

    def _keep_reserved(self, keep: Callable[[str], bool]) -> None:
        """Drop the reservations whose keys `keep` refuses."""
        with self._reserved_lock:
            self._reserved = {k: r for k, r in self._reserved.items() if keep(k)}
            self._reserved_at = {k: t for k, t in self._reserved_at.items() if k in self._reserved}


def _placer(
    planning: PlanningInput,
    jobs: Iterable[JobSpec],
    request: JobRequest,
    promises: Iterable[HeldGpus],
    problem: AllocationProblem,
) -> Callable[[dict[str, tuple[int, ...]]], dict[str, tuple[int, ...]]]:
    """Rows of counts per job (the new one "new") -> the counts they run placed slot by slot on
    the snapshot's nodes (`NodeFacts.place_rows`), in the loop's order; the promises of jobs
    `problem` does not list yet take their GPUs first."""
    listed = {job.job_id for job in problem.jobs}
    held = {
        key: row
        for h in promises
        for key in h.gpus
        if key not in listed and key != "new" and (row := h.over(problem, key)) is not None
    }
    ids = {key: -2 - i for i, key in enumerate(held)} | {"new": -1}
    # Higher priority, then earlier deadline, then older first (`dispatch/service.decide`).
    rank: dict[int, tuple[float, float, int]] = {i: (-math.inf, 0.0, i) for i in ids.values()}
    assert request.deadline is not None
    rank[-1] = (-request.priority, _aware(request.deadline).timestamp(), -1)
    for key, job in planning.jobs.items():
        ids[key] = job.job_id
        due = _aware(job.deadline_at).timestamp() if job.deadline_at else math.inf
        rank[job.job_id] = (-job.priority, due, job.job_id)
    allowed = {ids[job.job_id]: job.allowed_gpus for job in jobs}

    def placed(gpus: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        rows = {ids[k]: r for k, r in {**held, **gpus}.items()}
        out = planning.nodes.place_rows(rows, allowed, sorted(rows, key=rank.__getitem__))
        return {k: out[ids[k]] for k in gpus}

    return placed


def _rekeyed(held: HeldGpus, old: str, new: str) -> HeldGpus:
    """`held`'s promise to the job `old`, as one to the job `new`."""
    return HeldGpus(
        held.start_at,
        held.slot_s,
        {new: held.gpus[old]},
        {new: w} if (w := held.power_w.get(old)) is not None else {},
        {new: t} if (t := held.teams.get(old)) is not None else {},
    )


def _aware(at: datetime) -> datetime:
    """SQLite returns naive datetimes: they are UTC."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)
