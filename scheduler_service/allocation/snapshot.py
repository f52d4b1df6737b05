"""The one problem builder: a `ClusterSnapshot` plus `ProblemKnobs` in, an `AllocationProblem` out.

The live control loop (`planning.read_snapshot`), admission (`admission.Admission`) and
the simulator (`simulate/engine.py`) each read their own world into a `ClusterSnapshot` and call
`build_problem` on it, so the rules below hold in all three (docs/allocation.md, "One problem
builder"):

- priority: a job of user priority p (>= 0) weighs p + 1 in the objective;
- change cost: `ProblemKnobs.change_cost_s`, the seconds of progress one GPU-count change costs
  (at least 1 s, a tie-breaker towards stable plans);
- deadline margin: policies see a deadline `deadline_margin_s` early, but only while the job can
  still make the earlier deadline at full speed (a margin that turned a just-meetable deadline
  into a lost one would cause the very miss it guards against);
- requested GPUs: the count a fixed-size policy runs the job at (0: its largest allowed count);
- current GPUs: a count outside the job's allowed counts is seen as 0 (the job restarts);
- a lost promise: a guaranteed deadline the job can no longer make even at its fastest count
  weighs `lost_promise_weight` times its priority, so the plans still finish it as early as the
  kept promises allow (its lateness) instead of treating it like any other job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from scheduler_service.allocation.problem import (
    AllocationProblem,
    BudgetMode,
    BudgetPeriod,
    JobSpec,
    TeamBudget,
)

# Least change cost (s): a change is never free, so equal plans prefer the stable one.
MIN_CHANGE_COST_S = 1.0


@dataclass(frozen=True, order=True)
class BudgetWindow:
    """One carbon-budget window: its bounds (s, on the caller's clock) and its kg."""

    start_s: float
    end_s: float
    budget_kg: float


@dataclass(frozen=True)
class TeamWindows:
    """A team's hard budget left per period the horizon touches, and its jobs (by job id)."""

    team: str
    job_ids: frozenset[str]
    windows: tuple[BudgetWindow, ...]


@dataclass(frozen=True)
class PlannableJob:
    """One job as read from the world: its model over its allowed counts and its work left."""

    job_id: str
    allowed_gpus: tuple[int, ...]
    throughput_samples_per_s: tuple[float, ...]  # one per allowed count
    power_w: tuple[float, ...]  # one per allowed count
    remaining_samples: float
    deadline_s: float | None = None  # s from the snapshot's start, as promised (no margin)
    priority: int = 0  # the user's priority (>= 0)
    current_gpus: int = 0
    best_effort: bool = False
    requested_gpus: int = 0  # 0: the largest allowed count
    started: bool = False  # it ran before (a resume from 0 GPUs stalls it)


@dataclass(frozen=True)
class ClusterSnapshot:
    """What one planning step knows: ready GPUs per node, the forecast, the jobs, budget left."""

    start_at: datetime
    slot_s: float
    num_slots: int
    node_gpus: tuple[int, ...]  # GPUs of each ready node
    intensity_g_per_kwh: tuple[float, ...]  # one per slot
    jobs: tuple[PlannableJob, ...]
    # Budget left per period the horizon touches, bounds in s from `start_at`.
    budget_windows: tuple[BudgetWindow, ...] = ()
    pue: float = 1.0
    # Teams' hard budgets: only each team's jobs count against its windows.
    team_budgets: tuple[TeamWindows, ...] = ()
    # GPUs of each ready node a job may span (its agent advertised an address the others reach).
    spannable_gpus: tuple[int, ...] = ()

    @property
    def capacity_gpus(self) -> int:
        """GPUs on ready nodes."""
        return sum(self.node_gpus)

    @property
    def job_gpus_max(self) -> int:
        """The most GPUs one job can be placed on (`most_gpus_per_job`)."""
        return most_gpus_per_job(self.node_gpus, self.spannable_gpus)


def most_gpus_per_job(node_gpus: Sequence[int], spannable_gpus: Sequence[int]) -> int:
    """The most GPUs one job can be placed on: the largest node, or every node it may span
    together (two or more), as `placement.place_jobs` places it with `span_nodes`."""
    spanned = sum(spannable_gpus) if len(spannable_gpus) > 1 else 0
    return max(max(node_gpus, default=0), spanned)


@dataclass(frozen=True)
class ProblemKnobs:
    """How a snapshot becomes a problem: the settings in which the callers may differ."""

    budget_mode: BudgetMode = BudgetMode.HARD
    carbon_price_s_per_kg: float = 0.0
    change_cost_s: float = MIN_CHANGE_COST_S
    deadline_margin_s: float = 0.0
    # Progress (s) a count change or resume stalls a job for, counted in plans (0: none).
    switch_stall_s: float = 0.0


def plan_job(job: PlannableJob, knobs: ProblemKnobs) -> JobSpec:
    """The solver's view of one job under the builder's rules (module docstring)."""
    deadline = job.deadline_s
    margin_s = 0.0
    if deadline is not None and knobs.deadline_margin_s > 0:
        fastest_s = job.remaining_samples / max(job.throughput_samples_per_s)
        if deadline - knobs.deadline_margin_s >= fastest_s:
            margin_s = knobs.deadline_margin_s
            deadline -= margin_s
    return JobSpec(
        job_id=job.job_id,
        allowed_gpus=job.allowed_gpus,
        throughput_samples_per_s=job.throughput_samples_per_s,
        power_w=job.power_w,
        remaining_samples=float(job.remaining_samples),
        deadline_s=deadline,
        priority=float(max(job.priority, 0) + 1),
        current_gpus=job.current_gpus if job.current_gpus in job.allowed_gpus else 0,
        best_effort=job.best_effort,
        requested_gpus=job.requested_gpus,
        started=job.started,
        deadline_margin_s=margin_s,
    )


def lost_promise_weight(run_s: float, others_weight: float, slot_s: float, num_slots: int) -> float:
    """Weight factor of a job whose promise is lost: a slot of its delay outweighs delaying
    every other job (`others_weight`: their priorities together) for its whole remaining run
    (`run_s` at its fastest count, counted up to the horizon)."""
    return 1.0 + others_weight * max(1, min(math.ceil(run_s / slot_s), num_slots))


def build_problem(snapshot: ClusterSnapshot, knobs: ProblemKnobs) -> AllocationProblem:
    """The allocation problem of a snapshot (pure: no I/O, no clock)."""
    problem = _problem(snapshot, knobs)
    # A promise no plan can keep any more (a fault, a model far off, a stall the plans missed)
    # is still a promise: its lateness comes before the other jobs' completion times (below
    # the deadlines still kept: `M` grows with the weights). Weighed like any job, a late job
    # with much work left yielded to every shorter one (the fractional completion term favours
    # finishing short jobs first), so its lateness grew with the queue.
    lost = {
        job.job_id
        for job in problem.jobs
        if job.deadline_s is not None and not job.best_effort and problem.deadline_impossible(job)
    }
    if not lost:
        return problem
    total = sum(job.priority for job in problem.jobs)
    jobs = tuple(
        replace(
            job,
            priority=job.priority
            * lost_promise_weight(
                job.remaining_samples / problem.usable_max_rate(job),
                total - job.priority,
                problem.slot_s,
                problem.num_slots,
            ),
        )
        if job.job_id in lost
        else job
        for job in problem.jobs
    )
    return replace(problem, jobs=jobs)


def _problem(snapshot: ClusterSnapshot, knobs: ProblemKnobs) -> AllocationProblem:
    return AllocationProblem(
        start_at=snapshot.start_at,
        slot_s=snapshot.slot_s,
        capacity_gpus=(snapshot.capacity_gpus,) * snapshot.num_slots,
        intensity_g_per_kwh=snapshot.intensity_g_per_kwh,
        jobs=tuple(plan_job(job, knobs) for job in snapshot.jobs),
        pue=snapshot.pue,
        budget_periods=tuple(
            BudgetPeriod(start_s=w.start_s, end_s=w.end_s, budget_left_kg=w.budget_kg)
            for w in snapshot.budget_windows
        ),
        budget_mode=knobs.budget_mode,
        team_budgets=tuple(
            TeamBudget(
                team=t.team,
                job_ids=t.job_ids,
                periods=tuple(
                    BudgetPeriod(start_s=w.start_s, end_s=w.end_s, budget_left_kg=w.budget_kg)
                    for w in t.windows
                ),
            )
            for t in snapshot.team_budgets
        ),
        carbon_price_s_per_kg=knobs.carbon_price_s_per_kg,
        change_cost_s=max(knobs.change_cost_s, MIN_CHANGE_COST_S),
        switch_stall_s=knobs.switch_stall_s,
    )
