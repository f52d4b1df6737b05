"""GreenFlow's policy: the solver, guarded so that a tick's plan never loses to a simple plan.

The solver's rounding and warm start are heuristics; on a busy tick they can return a plan that
misses a deadline another plan meets (measured on ElasticFlow traces: a job admitted with a met
deadline later missed because one tick's warm-started rounding dropped it). Deadline misses cost
more than everything else in the objective, so the guard also builds a few cheap deadline-safe
candidates (ElasticFlow-style EDF with and without filling spare GPUs, and the solver without the
warm start when the first plan misses a deadline; each where it fits the limit by size) and
returns the feasible plan with the lowest objective. By construction the result is never worse on
the objective than those of the baselines it built.
Where `solve` already built the EDF plans as its own candidates (small problems), the guard reuses
them (and the cold re-solve reuses all of solve's baseline plans) instead of building them again.
"""

from __future__ import annotations

import time

from scheduler_service.allocation.baselines import carbon_agnostic, lean_edf
from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    evaluate_gpus,
    make_plan,
)
from scheduler_service.allocation.solver import solve_with_baselines
from scheduler_service.allocation.stalls import padded_plan
from scheduler_service.allocation.steps import guard_edf_fits, guard_resolve_fits


def _misses(plan: AllocationPlan) -> int:
    return sum(1 for ok in plan.deadline_met.values() if not ok)


def _feasible(problem: AllocationProblem, plan: AllocationPlan) -> bool:
    ev = evaluate_gpus(problem, plan.gpus)
    return ev.capacity_ok and ev.allowed_ok and ev.budget_ok


def greenflow(
    problem: AllocationProblem,
    *,
    previous: AllocationPlan | None = None,
    time_limit_s: float = 2.0,
    seed: int = 0,
) -> AllocationPlan:
    """The solver's plan, or a deadline-safe alternative when that scores better on the objective."""
    started = time.perf_counter()
    solved = solve_with_baselines(problem, previous=previous, time_limit_s=time_limit_s, seed=seed)
    first = solved.plan
    candidates = [first]
    # Built here only where `solve` did not and they fit the limit by size (not at thousands
    # of jobs x hundreds of slots, where they took half the policy's time).
    build = guard_edf_fits(problem, time_limit_s)
    for name, baseline in (("lean-edf", lean_edf), ("carbon-agnostic", carbon_agnostic)):
        plan = solved.baselines.get(name)
        if plan is None and build:
            plan = baseline(problem, previous=None, time_limit_s=time_limit_s, seed=seed)
        if plan is not None:
            candidates.append(plan)
    if previous is not None and _misses(first) > 0 and guard_resolve_fits(problem, time_limit_s):
        # The warm start can anchor the rounding on a stale plan; try once without it (where a
        # second solve fits the limit by size: not at thousands of jobs x hundreds of slots).
        cold = solve_with_baselines(
            problem,
            previous=None,
            time_limit_s=time_limit_s,
            seed=seed,
            baselines=solved.baselines or None,
        )
        candidates.append(cold.plan)
    # Each padded for switch stalls where only they make it late (stalls.py).
    candidates = [padded_plan(problem, p) for p in candidates]
    first = candidates[0]
    feasible = [p for p in candidates if _feasible(problem, p)] or [first]
    best = min(feasible, key=lambda p: p.objective)
    if best is first:
        return first
    note = f"deadline guard: {best.policy} plan scored better than the solver's"
    return make_plan(
        problem,
        best.gpus,
        status="heuristic",
        policy="greenflow",
        solve_s=time.perf_counter() - started,
        bound=first.bound,
        notes=(*best.notes, note),
    )
