"""Which steps `solve` runs: one time budget shared by size estimates, and the tuning behind it.

Which steps run depends on the problem's size and the time limit only, never on the clock, so a
fixed seed gives the same plan under any load (docs/allocation.md, "How `solve` works"). The
measurements behind each constant of `SolverTuning` are in docs/allocation.md, "Solver tuning".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler_service.allocation.polish import polish_pass_s
from scheduler_service.allocation.problem import AllocationProblem, PlanArrays, plan_arrays


@dataclass(frozen=True)
class SolverTuning:
    """Every constant that decides what `solve` runs and how far; defaults are the measured ones.

    Seconds-per-unit figures are pessimistic size estimates (a loaded 2-core machine must still
    fit the limit); they decide what runs from the size alone.
    """

    # Above this many binaries the exact MIP is skipped (LP + rounding alone).
    exact_max_binaries: int = 150
    # The near-deadline MIP covers at most this many binaries.
    near_max_binaries: int = 600
    # HiGHS branch-and-bound node limit: a work limit, so answers do not depend on load.
    mip_max_nodes: int = 500
    # HiGHS wall-clock limit, only a safety net no measured MIP came near.
    mip_safety_net_s: float = 30.0
    # Estimated MIP seconds per binary (decides whether a MIP runs).
    mip_seconds_per_binary: float = 5e-4
    # The deadline repair re-evaluates whole plans per move: only on problems this small.
    repair_max_jobs: int = 100
    # Moves the repair tries at most (a count, not a clock).
    repair_max_trials: int = 2000
    # Candidates the repair mends at most, best first, while its moves last.
    repair_candidates: int = 3
    # Estimated seconds of the LP with its two roundings per (valid option x slot) cell.
    lp_seconds_per_cell: float = 2e-5
    # Estimated seconds of one greedy round with its evaluation, per cell and per slot.
    greedy_seconds_per_cell: float = 3e-7
    greedy_seconds_per_slot: float = 6e-4
    # Greedy rounds at most (more did not help on the bench).
    greedy_max_passes: int = 4
    # Greedy rounds that start from the LP's finish times (where the LP ran), at most, and the
    # share of the limit they may take (docs/allocation.md, "LP-seeded greedy").
    lp_greedy_max_rounds: int = 2
    lp_greedy_share: float = 0.3
    # Share of the finishing slot's GPU price a later round adds to a finishing job's worth.
    finish_worth_share: float = 0.5
    # Estimated seconds of all five baseline plans per cell.
    baseline_seconds_per_cell: float = 8e-6
    # Estimated seconds of one deadline-repair move: a whole-plan evaluation plus a copy.
    repair_seconds_per_trial: float = 5e-4
    repair_seconds_per_cell: float = 3e-8
    # Local-search passes at most; each runs only while its plan-sized estimate fits.
    polish_max_passes: int = 4
    # Share of the time limit one step may take at most, so no step starves the later ones.
    greedy_share: float = 0.6
    lp_share: float = 0.5
    mip_share: float = 0.5
    baselines_share: float = 0.25
    polish_share: float = 0.5
    # The guard's cold re-solve (guarded.py) runs only while one greedy round is estimated at
    # most this share of the limit: a second solve costs about what the first did, and at 5,000
    # jobs x 288 slots it doubled a 5 s policy's time (the estimate: 1.9 s a round).
    guard_resolve_share: float = 0.2
    # The guard builds its two EDF plans itself (where `solve` did not) only while their
    # estimate (two of the five baselines) fits this share of the limit: at 5,000 jobs x 288
    # slots they took half the policy's time.
    guard_edf_share: float = 0.5


TUNING = SolverTuning()


@dataclass(frozen=True)
class SolveSteps:
    """Which steps `solve` runs, decided from the problem's size and the time limit only.

    One budget, the time limit, is shared: in the order below each optional step runs only when
    its size estimate fits its own share of the limit and what the steps before it left, so the
    estimates of the steps that run add up to at most the limit. The first greedy round runs in
    any case (without it there may be no plan); a forced LP (`use_lp=True`) is charged even when
    it does not fit. Order: first greedy round, LP with its roundings, near-deadline MIP, exact
    MIP, baselines, further greedy rounds, the chase round, greedy rounds from the LP's finish
    times, deadline-repair moves (as many as what is left pays for), local-search passes over
    the best plan and over the best LP-seeded plan (`solve` adds the repair moves it did not use
    to their budgets). Candidate evaluations and the plan's report are not
    estimated.
    """

    greedy_rounds: int
    chase: bool
    lp: bool
    near_mip_slots: int | None
    exact_mip: bool
    baselines: bool
    repair_trials: int
    polish_passes: int = 0  # at most; each runs only while its plan-sized estimate fits
    polish_budget_s: float = 0.0
    lp_greedy_rounds: int = 0  # greedy rounds from the LP's finish times (0: none)
    # The local search over the best LP-seeded plan, where one exists (same passes as above).
    lp_polish_budget_s: float = 0.0
    estimates_s: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        """Summed size estimates of the steps that may run (seconds)."""
        return float(sum(self.estimates_s.values()))


def greedy_round_s(arrays: PlanArrays, num_slots: int, tuning: SolverTuning = TUNING) -> float:
    """Size estimate of one greedy round with its evaluation (seconds)."""
    cells = int(arrays.valid.sum()) * num_slots
    return cells * tuning.greedy_seconds_per_cell + num_slots * tuning.greedy_seconds_per_slot


def near_deadline_slots(problem: AllocationProblem) -> int | None:
    """Slots the near-deadline MIP covers: up to the last deadline inside the horizon (None: no
    such deadline, or it would cover the whole horizon)."""
    deadlines = [
        j.deadline_s
        for j in problem.jobs
        if j.deadline_s is not None and 0 < j.deadline_s < problem.horizon_s
    ]
    if not deadlines:
        return None
    slots = int(np.ceil(max(deadlines) / problem.slot_s))
    return slots if slots < problem.num_slots else None


def plan_steps(
    problem: AllocationProblem,
    arrays: PlanArrays,
    time_limit_s: float,
    *,
    use_lp: bool | None = None,
    chase: bool = False,
    use_baselines: bool = True,
    tuning: SolverTuning = TUNING,
) -> SolveSteps:
    """The steps `solve` runs within `time_limit_s`, by size estimates (see SolveSteps).

    `chase`: some deadline job got no reservation, so the chase round is wanted.
    `use_baselines`: False leaves the baselines' plans out of the candidates.
    """
    num_slots = problem.num_slots
    cells = int(arrays.valid.sum()) * num_slots
    spent: dict[str, float] = {}

    def take(name: str, estimate_s: float, share: float, before_s: float = 0.0) -> bool:
        """Charge the step when it fits its share (less `before_s` of it already taken) and
        what is left of the limit."""
        left_s = time_limit_s - sum(spent.values())
        if estimate_s <= share * time_limit_s - before_s and estimate_s <= left_s:
            spent[name] = estimate_s
            return True
        return False

    round_s = greedy_round_s(arrays, num_slots, tuning)
    spent["greedy"] = round_s
    lp_s = cells * tuning.lp_seconds_per_cell
    if use_lp:
        spent["lp"] = lp_s
    run_lp = bool(use_lp) or (use_lp is None and take("lp", lp_s, tuning.lp_share))
    near = near_deadline_slots(problem) if run_lp else None
    if near is not None:
        binaries = int(arrays.valid.sum()) * near * 2
        if binaries > tuning.near_max_binaries or not take(
            "near_mip", binaries * tuning.mip_seconds_per_binary, tuning.mip_share
        ):
            near = None
    binaries = cells * 2
    exact = (
        run_lp
        and binaries <= tuning.exact_max_binaries
        and take("exact_mip", binaries * tuning.mip_seconds_per_binary, tuning.mip_share)
    )
    baselines = use_baselines and take(
        "baselines", cells * tuning.baseline_seconds_per_cell, tuning.baselines_share
    )
    rounds = 1
    while rounds < tuning.greedy_max_passes and take(
        f"greedy_{rounds + 1}", round_s, tuning.greedy_share, rounds * round_s
    ):
        rounds += 1
    chase = chase and take("chase", round_s, 1.0)
    lp_rounds = 0
    while (
        run_lp
        and lp_rounds < tuning.lp_greedy_max_rounds
        and take(f"lp_greedy_{lp_rounds + 1}", round_s, tuning.lp_greedy_share, lp_rounds * round_s)
    ):
        lp_rounds += 1
    trials = 0
    if run_lp and len(problem.jobs) <= tuning.repair_max_jobs:
        trial_s = tuning.repair_seconds_per_trial + cells * tuning.repair_seconds_per_cell
        left_s = max(0.0, time_limit_s - sum(spent.values()))
        trials = min(tuning.repair_max_trials, int(left_s // trial_s))
        if trials > 0:
            spent["repair"] = trials * trial_s
    # Last, so that it takes nothing from the steps before (the repair keeps its moves); where
    # the repair runs it usually leaves too little for a pass (at <= 1 s).
    # The budget is reserved when the smallest pass (one candidate per job) fits; how many
    # passes it pays for depends on the plan polish starts from.
    # With LP-seeded plans the local search runs twice (over the best plan and over the best
    # LP-seeded one), each on half of what is left.
    starts = 2 if lp_rounds else 1
    left_s = max(0.0, time_limit_s - sum(spent.values()))
    polish_budget_s = min(tuning.polish_share * time_limit_s, left_s / starts)
    passes = 0
    lp_polish_budget_s = 0.0
    if polish_pass_s(len(problem.jobs), num_slots) <= polish_budget_s:
        spent["polish"] = polish_budget_s
        passes = tuning.polish_max_passes
        if lp_rounds:
            lp_polish_budget_s = spent["lp_polish"] = polish_budget_s
    else:
        polish_budget_s = 0.0
    return SolveSteps(
        greedy_rounds=rounds,
        chase=chase,
        lp=run_lp,
        near_mip_slots=near,
        exact_mip=exact,
        baselines=baselines,
        repair_trials=trials,
        polish_passes=passes,
        polish_budget_s=polish_budget_s,
        lp_greedy_rounds=lp_rounds,
        lp_polish_budget_s=lp_polish_budget_s,
        estimates_s=spent,
    )


def guard_resolve_fits(
    problem: AllocationProblem, time_limit_s: float, tuning: SolverTuning = TUNING
) -> bool:
    """Whether the guard's cold re-solve fits the limit (by size: one greedy round's estimate)."""
    round_s = greedy_round_s(plan_arrays(problem), problem.num_slots, tuning)
    return round_s <= tuning.guard_resolve_share * time_limit_s


def guard_edf_fits(
    problem: AllocationProblem, time_limit_s: float, tuning: SolverTuning = TUNING
) -> bool:
    """Whether the guard's own two EDF plans fit the limit (by size: 2/5 of the baselines')."""
    cells = int(plan_arrays(problem).valid.sum()) * problem.num_slots
    estimate_s = cells * tuning.baseline_seconds_per_cell * 2 / 5
    return estimate_s <= tuning.guard_edf_share * time_limit_s
