"""Property tests at 20-60 jobs x 8-16 slots, where the exact MIPs no longer decide the plan.

Budgets come in several periods (boundaries anywhere, also mid-slot and outside the horizon),
so the hard-budget check is per period, not over the whole horizon.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.allocation.baselines import lean_edf
from scheduler_service.allocation.heuristic import greedy_run
from scheduler_service.allocation.policies import POLICIES
from scheduler_service.allocation.problem import (
    AllocationProblem,
    BudgetMode,
    BudgetPeriod,
    JobSpec,
    evaluate_gpus,
    plan_arrays,
)
from scheduler_service.allocation.solver import solve
from tests.allocation.test_properties import SLOT_S, START, check_hard_constraints

FEW = settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
COUNT_SETS = [(1,), (1, 2), (2, 4), (1, 2, 4), (1, 2, 4, 8), (2, 4, 8)]


@st.composite
def large_problems(draw: st.DrawFn) -> AllocationProblem:
    num_slots = draw(st.integers(min_value=8, max_value=16))
    num_jobs = draw(st.integers(min_value=20, max_value=60))
    seed = draw(st.integers(min_value=0, max_value=2**31))
    # Numbers from numpy (seeded by hypothesis): drawing 60 jobs field by field is slow.
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(num_jobs):
        counts = COUNT_SETS[int(rng.integers(len(COUNT_SETS)))]
        rate = float(rng.uniform(5.0, 50.0))
        exponent = float(rng.uniform(0.5, 1.0))
        watts = float(rng.uniform(100.0, 400.0))
        throughput = tuple(rate * g**exponent for g in counts)
        deadline = None
        if rng.random() < 0.5:
            deadline = float(rng.uniform(0.3, num_slots + 2.0)) * SLOT_S
        jobs.append(
            JobSpec(
                job_id=f"j{i}",
                allowed_gpus=counts,
                throughput_samples_per_s=throughput,
                power_w=tuple(watts * g**0.9 for g in counts),
                remaining_samples=max(throughput) * SLOT_S * float(rng.uniform(0.3, 6.0)),
                deadline_s=deadline,
                priority=float(rng.choice([1.0, 2.0])),
                current_gpus=int(rng.choice((0, *counts))),
            )
        )
    cluster = int(rng.integers(8, 65))
    capacity = tuple(max(0, cluster + int(rng.integers(-4, 5))) for _ in range(num_slots))
    intensity = rng.uniform(20.0, 600.0, num_slots)
    # 2-4 periods; each gets 0-60 % of what a full cluster at 300 W/GPU would emit in it.
    num_periods = int(rng.integers(2, 5))
    cuts = np.sort(rng.uniform(0.0, num_slots * SLOT_S, num_periods - 1))
    edges = [
        -float(rng.uniform(0, 2)) * SLOT_S,
        *cuts,
        (num_slots + float(rng.uniform(0, 3))) * SLOT_S,
    ]
    full_kg_per_slot = cluster * 300.0 * intensity * SLOT_S / 3600.0 / 1e6
    starts = np.arange(num_slots) * SLOT_S
    periods = []
    for lo, hi in itertools.pairwise(edges):
        share = np.clip(np.minimum(starts + SLOT_S, hi) - np.maximum(starts, lo), 0, None) / SLOT_S
        full_kg = float((full_kg_per_slot * share).sum())
        periods.append(BudgetPeriod(float(lo), float(hi), full_kg * float(rng.uniform(0.0, 0.6))))
    return AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=capacity,
        intensity_g_per_kwh=tuple(float(x) for x in intensity),
        jobs=tuple(jobs),
        budget_periods=tuple(periods),
        budget_mode=draw(st.sampled_from([BudgetMode.HARD, BudgetMode.HARD, BudgetMode.SOFT])),
        carbon_price_s_per_kg=draw(st.sampled_from([0.0, 500.0])),
        change_cost_s=30.0,
    )


@FEW
@given(problem=large_problems())
def test_solver_at_scale_keeps_budgets_per_period(
    problem: AllocationProblem,
) -> None:
    # The solver without the baselines among its candidates keeps every hard constraint and
    # reports its own objective. Whether it also beats each baseline is measured, not asserted:
    # it does not on every problem (on random problems of this generator, 2 of 230: one by
    # 0.11 % on completion time, which the local search now mends, one by a deadline lean EDF
    # meets that the deadline repair cannot mend); `python -m bench.solver_scale --baseline-wins`
    # counts it (docs/allocation.md, "How `solve` works", step 8).
    plan = solve(problem, time_limit_s=0.5, seed=0, use_baselines=False)
    check_hard_constraints(problem, plan.gpus)
    assert plan.objective == pytest.approx(evaluate_gpus(problem, plan.gpus).objective)
    others = {name: p for name, p in POLICIES.items() if name != "greenflow"}
    for policy in {**others, "lean-edf": lean_edf}.values():
        check_hard_constraints(
            problem, policy(problem, previous=None, time_limit_s=0.5, seed=0).gpus
        )
    # The registered policy (solver with the baselines as candidates, and the guard) keeps the
    # constraints and is never worse than the solver alone, though the baselines take a share of
    # the time budget from the other steps (it was, before the repair mended more than the best
    # candidate: docs/allocation.md, "Deadline repair").
    guarded = POLICIES["greenflow"](problem, previous=None, time_limit_s=0.5, seed=0)
    check_hard_constraints(problem, guarded.gpus)
    assert guarded.objective <= plan.objective * (1 + 1e-9) + 1e-6


@FEW
@given(problem=large_problems())
def test_heuristic_plans_keep_budgets_per_period(problem: AllocationProblem) -> None:
    # Every plan of the reservation + pricing heuristic (the path of large problems), cold and
    # with later rounds, keeps capacity, allowed counts and each period's budget on its own.
    arrays = plan_arrays(problem)
    for gpus, ev in greedy_run(problem, arrays, None, None, passes=2).plans:
        check_hard_constraints(problem, gpus)
        assert ev.capacity_ok and ev.allowed_ok and ev.budget_ok
