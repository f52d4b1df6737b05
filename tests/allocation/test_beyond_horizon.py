"""Under a hard budget, slot ends by which no plan can have finished a job count whole.

There the job is unfinished whenever its work runs, so the objective values the work done, not how
early it ran (PlanArrays.area_weights, certainly_unfinished_slots).
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import numpy as np
import pytest

from scheduler_service.allocation.problem import (
    UNFINISHED_SLOT_WEIGHT,
    AllocationProblem,
    BudgetMode,
    BudgetPeriod,
    JobSpec,
    evaluate_gpus,
    horizon_work_bound,
    plan_arrays,
)
from scheduler_service.allocation.solver import solve

START = datetime(2022, 6, 1, tzinfo=UTC)
SLOT_S = 900.0
# Four slots at 400 g/kWh, then four 15 % cleaner ones.
INTENSITY = (400.0,) * 4 + (340.0,) * 4
# One GPU (300 W) for one slot at 340 g/kWh; the budget pays four of them.
ONE_GPU_CLEAN_SLOT_KG = 300.0 * SLOT_S / 3600.0 / 1000.0 * 340.0 / 1000.0
BUDGET_KG = 4.0 * ONE_GPU_CLEAN_SLOT_KG * (1 + 1e-6)
RATE = {0: 0.0, 1: 10.0, 2: 18.0}  # samples/s per GPU count


def problem_with(slots_of_work: float, mode: BudgetMode = BudgetMode.HARD) -> AllocationProblem:
    """One job (1 or 2 GPUs) with `slots_of_work` slots of work at 1 GPU, 8 slots."""
    job = JobSpec("big", (1, 2), (RATE[1], RATE[2]), (300.0, 600.0), slots_of_work * 10.0 * SLOT_S)
    return AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=(2,) * 8,
        intensity_g_per_kwh=INTENSITY,
        jobs=(job,),
        # The period holds the horizon's end: leftover work is paid at its rate after it.
        budget_periods=(BudgetPeriod(0.0, 8 * SLOT_S, BUDGET_KG),),
        budget_mode=mode,
    )


def samples(gpus: tuple[int, ...]) -> float:
    """Samples the job does in a plan (it never finishes inside the horizon here)."""
    return sum(RATE[g] for g in gpus) * SLOT_S


def best_plans(problem: AllocationProblem) -> list[tuple[float, tuple[int, ...]]]:
    """Every plan within the budget, best objective first (brute force)."""
    out = []
    kg_per_w = problem.slot_emissions_kg_per_w()
    for gpus in itertools.product((0, 1, 2), repeat=problem.num_slots):
        # Skip the plans far over the budget without a full evaluation (300 W per GPU).
        if float(np.dot(gpus, kg_per_w)) * 300.0 > BUDGET_KG * 1.01:
            continue
        ev = evaluate_gpus(problem, {"big": gpus})
        if ev.budget_ok:
            out.append((ev.objective, gpus))
    return sorted(out)


def test_budget_goes_to_the_cleanest_slots_when_the_job_cannot_finish() -> None:
    # 4.2 slots of work need more kg than the budget even at 1 GPU in the clean slots, so no plan
    # finishes the job inside the horizon: its completion is past the end whatever runs when.
    problem = problem_with(4.2)
    arrays = plan_arrays(problem)
    assert arrays.unfinished_slots.tolist() == [8]
    assert arrays.area_weights.tolist() == [[UNFINISHED_SLOT_WEIGHT] * 8]
    plan = solve(problem, time_limit_s=2.0, seed=0)
    ev = evaluate_gpus(problem, plan.gpus)
    assert ev.budget_ok and plan.emissions_kg <= BUDGET_KG * (1 + 1e-6)
    # The budget buys four clean GPU-slots: the most work any plan within it does.
    assert plan.gpus["big"] == (0, 0, 0, 0, 1, 1, 1, 1)
    ranked = best_plans(problem)
    assert ranked[0][1] == plan.gpus["big"]
    assert samples(plan.gpus["big"]) == max(samples(g) for _, g in ranked)
    # The bound that classed the job is an upper bound on the work of every plan in the budget
    # (here it is met: four clean slots at 1 GPU).
    bound = horizon_work_bound(problem, plan_arrays(problem))[0]
    assert max(samples(g) for _, g in ranked) <= bound * (1 + 1e-9)
    assert bound == pytest.approx(samples(plan.gpus["big"]), rel=1e-5)
    # With the full completion area (the old objective) the best plan spends the budget in the
    # first, dirtier slots: work early counted at every later slot end although the job
    # finishes after the horizon anyway, and it buys 25 % less work for the same budget.
    arrays.area_weights = np.ones((1, 8))
    arrays.later_weight = np.arange(8, 0, -1, dtype=float)[None, :]
    old_best = best_plans(problem)[0][1]
    assert old_best == (1, 1, 1, 0, 0, 0, 0, 0)
    assert samples(old_best) < 0.8 * samples(plan.gpus["big"])


def test_only_slots_no_plan_can_finish_by_count_whole() -> None:
    # Two slots of work at 1 GPU: at 2 GPUs (within the budget) it is done inside slot 1, but
    # slot 0 alone does at most 1.8 slots of work, so only slot 0's end counts whole.
    arrays = plan_arrays(problem_with(2.0))
    first = int(arrays.unfinished_slots[0])
    assert first == 1
    bound = horizon_work_bound(problem_with(2.0), arrays, upto=np.array([first + 1]))
    assert bound[0] >= arrays.remaining[0] * (1 - 1e-9)
    assert (
        horizon_work_bound(problem_with(2.0), arrays, upto=np.array([first]))[0]
        < (arrays.remaining[0])
    )
    assert arrays.area_weights[0].tolist() == [UNFINISHED_SLOT_WEIGHT] * first + [1.0] * (8 - first)
    # Soft budgets bind nothing, so nothing is known about when a job finishes.
    soft = problem_with(4.2, BudgetMode.SOFT)
    assert plan_arrays(soft).area_weights.tolist() == [[1.0] * 8]
