"""GreenFlow's allocation solver: every step proposes candidate plans, the best feasible one wins.

Steps (docs/allocation.md, "How `solve` works"): the reservation + pricing heuristic always
(`heuristic.py`), the horizon LP (HiGHS, `highs.py`) with its roundings, the near-deadline and
exact MIPs when small enough (`rounding.py`), the baselines' plans, the deadline repair and a
local search over the best plan (`polish.py`). Which steps run depends on the problem's size and
the time limit only (`steps.plan_steps`), never on the clock, and the MIPs stop on HiGHS node
limits, so a fixed seed gives the same plan under any load. The objective is lexicographic
through weights: deadline misses first, then priority-weighted completion time, then carbon (at
the problem's price) and GPU-count changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from scheduler_service.allocation import baselines
from scheduler_service.allocation.heuristic import (
    deadline_reservation,
    greedy_run,
    lp_finish_slots,
    needs_chase,
    previous_finish,
    previous_worth,
    shift_previous,
)
from scheduler_service.allocation.highs import LpResult, solve_lp, solve_mip
from scheduler_service.allocation.polish import polish, polish_pass_s
from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    PlanEvaluation,
    evaluate_gpus,
    gpus_from_options,
    make_plan,
    option_matrix,
    plan_arrays,
    trim_after_finish,
)
from scheduler_service.allocation.rounding import (
    lp_deadline_met,
    near_deadline_mip,
    repair_deadlines,
    round_lp,
)
from scheduler_service.allocation.stalls import pad_for_stalls
from scheduler_service.allocation.steps import TUNING, SolverTuning, plan_steps


def baseline_plans(
    problem: AllocationProblem, time_limit_s: float, seed: int
) -> list[AllocationPlan]:
    """The plans of every baseline policy and lean EDF on this problem (cold: no previous)."""
    policies = (
        baselines.carbon_agnostic,
        baselines.lean_edf,
        baselines.static_fcfs,
        baselines.carbon_greedy,
        baselines.temporal_shift,
    )
    return [
        policy(problem, previous=None, time_limit_s=time_limit_s, seed=seed) for policy in policies
    ]


def solve(
    problem: AllocationProblem,
    *,
    previous: AllocationPlan | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
    use_lp: bool | None = None,
    use_baselines: bool = True,
) -> AllocationPlan:
    """Best plan within a budget of `time_limit_s` (deterministic for a fixed seed).

    The limit picks the steps by their size-estimated cost (never the clock; `plan_steps`), so
    a loaded machine returns the same plan, later. `use_lp` forces the horizon LP on or off; by
    default it runs when its estimate fits half the limit and what the first greedy round left.
    `use_baselines=False` leaves the baselines' plans out of the candidates.
    """
    return solve_with_baselines(
        problem,
        previous=previous,
        time_limit_s=time_limit_s,
        seed=seed,
        use_lp=use_lp,
        use_baselines=use_baselines,
    ).plan


@dataclass(frozen=True)
class SolveResult:
    """`solve`'s plan, the baseline plans it built as candidates (policy name -> plan), the
    steps that ran (`plan_steps` names, in order) and the step that produced the plan."""

    plan: AllocationPlan
    baselines: dict[str, AllocationPlan]
    ran: tuple[str, ...] = ()
    chosen: str = ""


@dataclass(frozen=True)
class _Candidate:
    gpus: dict[str, tuple[int, ...]]
    status: str
    evaluation: PlanEvaluation
    step: str  # the step that produced it, "+step" for each step that improved it


def solve_with_baselines(
    problem: AllocationProblem,
    *,
    previous: AllocationPlan | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
    use_lp: bool | None = None,
    baselines: dict[str, AllocationPlan] | None = None,
    use_baselines: bool = True,
    tuning: SolverTuning = TUNING,
) -> SolveResult:
    """`solve`, also returning the baseline plans it built, so callers need not build them again.

    `baselines`: plans from an earlier call on the same problem, limit and seed (the baselines
    ignore `previous`), reused instead of rebuilt when the baseline step runs.
    """
    started = time.perf_counter()
    if not problem.jobs:
        empty = make_plan(problem, {}, status="optimal", policy="greenflow", solve_s=0.0, bound=0.0)
        return SolveResult(empty, {})
    arrays = plan_arrays(problem)
    protect, reserved = deadline_reservation(problem, arrays)
    steps = plan_steps(
        problem,
        arrays,
        time_limit_s,
        use_lp=use_lp,
        chase=needs_chase(problem, arrays, protect, reserved),
        use_baselines=use_baselines,
        tuning=tuning,
    )
    prefer = None
    warm = shift_previous(previous, problem)
    if warm is not None:
        prefer = {job_id: counts[0] for job_id, counts in warm.items()}
    # Every candidate is evaluated once.
    run = greedy_run(
        problem,
        arrays,
        prefer,
        previous_finish(previous, problem, arrays),
        steps.greedy_rounds,
        reservation=(protect, reserved),
        chase=steps.chase,
        worth=previous_worth(previous, problem, arrays, tuning.finish_worth_share),
        worth_share=tuning.finish_worth_share,
    )
    round_names = ["greedy", *(f"greedy_{n}" for n in range(2, steps.greedy_rounds + 1))]
    round_names += ["chase"] if steps.chase else []
    ran = list(round_names)
    candidates = [
        _Candidate(g, "heuristic", ev, name)
        for (g, ev), name in zip(run.plans, round_names, strict=True)
    ]

    def add(gpus: dict[str, tuple[int, ...]], step: str, status: str = "heuristic") -> None:
        candidates.append(_Candidate(gpus, status, evaluate_gpus(problem, gpus), step))

    if warm is not None:
        add(trim_after_finish(problem, warm), "warm_start")
    lp = solve_lp(problem, arrays) if steps.lp else None
    if lp is not None:
        ran.append("lp")
        for mode in ("ceil", "nearest"):
            add(
                trim_after_finish(problem, round_lp(problem, arrays, lp, prefer, mode)),
                f"lp_{mode}",
            )
        if steps.lp_greedy_rounds:
            # The greedy rounds again, valuing work against the LP's finish times instead of
            # the horizon's end: OR-Tools' relaxation seeds an integral plan the local search
            # then refines (docs/allocation.md, "LP-seeded greedy").
            ran.append("lp_greedy")
            seeded = greedy_run(
                problem,
                arrays,
                prefer,
                lp_finish_slots(problem, arrays, lp) + 0.5,
                steps.lp_greedy_rounds,
                reservation=(protect, reserved),
                chase=False,
                worth_share=tuning.finish_worth_share,
            )
            for n, (seeded_gpus, seeded_ev) in enumerate(seeded.plans, start=1):
                name = "lp_greedy" if n == 1 else f"lp_greedy_{n}"
                candidates.append(_Candidate(seeded_gpus, "heuristic", seeded_ev, name))
        if steps.near_mip_slots is not None:
            ran.append("near_mip")
            near = near_deadline_mip(problem, arrays, lp, prefer, steps.near_mip_slots, seed)
            if near is not None:
                add(near, "near_mip")
    built: dict[str, AllocationPlan] = {}
    if steps.baselines:
        ran.append("baselines")
        if baselines is None:
            baselines = {plan.policy: plan for plan in baseline_plans(problem, time_limit_s, seed)}
        built = baselines
        for name, plan in built.items():
            add(plan.gpus, f"baseline:{name}")
    # The candidates are built without switch stalls; mend those only the stalls make late.
    for i, c in enumerate(candidates):
        padded = pad_for_stalls(problem, c.gpus)
        if padded is not None:
            ev = evaluate_gpus(problem, padded)
            candidates[i] = _Candidate(padded, c.status, ev, f"{c.step}+stalls")
    feasible = [c for c in candidates if _ok(c.evaluation)]
    best = min(feasible, key=lambda c: c.evaluation.objective) if feasible else None
    unused_trials = steps.repair_trials
    if lp is not None and best is not None and steps.repair_trials > 0:
        best, unused_trials = _repair(problem, lp, feasible, best, steps.repair_trials, tuning, ran)
    polish_passes, polish_budget_s = steps.polish_passes, steps.polish_budget_s
    if steps.repair_trials > 0:
        # The repair's budget pays for every move it may try; the moves it did not need go to
        # the local search (a count, not a clock: the same plan under any load). Without them
        # the local search never ran where the repair ran at <= 1 s (docs/allocation.md,
        # "Solver tuning").
        polish_budget_s += unused_trials * steps.estimates_s["repair"] / steps.repair_trials
        if polish_pass_s(len(problem.jobs), problem.num_slots) <= polish_budget_s:
            polish_passes = tuning.polish_max_passes
    polished_by = 0.0
    polished: dict[str, tuple[int, ...]] | None = None
    if best is not None and polish_passes > 0:
        ran.append("polish")
        starts = [(best, polish_budget_s)]
        seeded_best = min(
            (c for c in feasible if c.step.startswith("lp_greedy")),
            key=lambda c: c.evaluation.objective,
            default=None,
        )
        if seeded_best is not None and seeded_best is not best and steps.lp_polish_budget_s > 0:
            starts.append((seeded_best, steps.lp_polish_budget_s))
        unpolished = best
        for start_from, budget_s in starts:
            start = option_matrix(problem, start_from.gpus, arrays)[0]
            refined = gpus_from_options(
                problem, arrays, polish(problem, arrays, start, polish_passes, budget_s=budget_s)
            )
            ev = evaluate_gpus(problem, refined)
            if _ok(ev) and ev.objective < best.evaluation.objective:
                polished = refined
                polished_by = unpolished.evaluation.objective - ev.objective
                best = _Candidate(refined, start_from.status, ev, f"{start_from.step}+polish")
    bound = None if lp is None else lp.bound
    status = "heuristic"
    if lp is not None and steps.exact_mip:
        ran.append("exact_mip")
        gpus, mip_bound, optimal = solve_mip(
            problem,
            arrays,
            seed,
            max_nodes=tuning.mip_max_nodes,
            safety_net_s=tuning.mip_safety_net_s,
        )
        if gpus is not None:
            gpus = trim_after_finish(problem, gpus)
            ev = evaluate_gpus(problem, gpus)
            if _ok(ev) and (best is None or ev.objective <= best.evaluation.objective):
                best = _Candidate(gpus, "optimal" if optimal else "feasible", ev, "exact_mip")
        if mip_bound is not None and bound is not None:
            bound = max(bound, mip_bound)
        if optimal and best is not None:
            status = "optimal"
    if best is None:
        # Nothing met the hard constraints (e.g. the budget is already spent): run nothing.
        idle = {job.job_id: (0,) * problem.num_slots for job in problem.jobs}
        best = _Candidate(idle, "heuristic", evaluate_gpus(problem, idle), "idle")
    notes: tuple[str, ...] = ()
    if lp is not None:
        notes = (f"lp_deadline_misses={float(lp.missed.sum()):.3f}",)
    if status != "optimal":
        status = best.status
        # A repaired plan is the repair's, not the baseline's, even when polished after.
        if best.step.startswith("baseline:") and "+repair" not in best.step:
            source = best.step.split("+")[0].removeprefix("baseline:")
            notes = (*notes, f"best candidate: the {source} baseline's plan")
    if polished is not None and best.gpus is polished:
        notes = (*notes, f"local search lowered the objective by {polished_by:.6g}")
    plan = make_plan(
        problem,
        best.gpus,
        status=status,
        policy="greenflow",
        solve_s=time.perf_counter() - started,
        bound=bound,
        notes=notes,
        evaluation=best.evaluation,
        gpu_price_per_slot=tuple(float(x) for x in run.gpu_price),
        step=best.step,
    )
    return SolveResult(plan, built, tuple(ran), best.step)


def _repair(
    problem: AllocationProblem,
    lp: LpResult,
    feasible: list[_Candidate],
    best: _Candidate,
    trials: int,
    tuning: SolverTuning,
    ran: list[str],
) -> tuple[_Candidate, int]:
    """The deadline repair on the best candidates that miss a deadline the LP meets, best
    first, while its moves last (at most `tuning.repair_candidates` candidates); returns the
    best candidate and the moves left unused.

    Why more than the best: a baseline's plan can score best and still be one the repair
    cannot mend (it spent a budget period early), while the LP rounding just behind it can be
    (docs/allocation.md, "Deadline repair")."""
    savable = {
        j.job_id for j, ok in zip(problem.jobs, lp_deadline_met(problem, lp), strict=True) if ok
    }

    def misses_savable(c: _Candidate) -> bool:
        return any(not ok for k, ok in c.evaluation.deadline_met.items() if k in savable)

    seen: list[dict[str, tuple[int, ...]]] = []
    for candidate in sorted(feasible, key=lambda c: c.evaluation.objective):
        if trials <= 0 or len(seen) >= tuning.repair_candidates:
            break
        if not misses_savable(candidate) or candidate.gpus in seen:
            continue
        seen.append(candidate.gpus)
        if "repair" not in ran:
            ran.append("repair")
        repaired, used = repair_deadlines(problem, candidate.gpus, savable, trials)
        trials -= used
        repaired = trim_after_finish(problem, repaired)
        ev = evaluate_gpus(problem, repaired)
        if _ok(ev) and ev.objective < best.evaluation.objective:
            best = _Candidate(repaired, "heuristic", ev, f"{candidate.step}+repair")
    return best, max(0, trials)


def _ok(ev: PlanEvaluation) -> bool:
    """The evaluated plan meets every hard constraint."""
    return ev.capacity_ok and ev.allowed_ok and ev.budget_ok
