"""The budget-aware objective tail: under a hard budget, leftover work waits for budget."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from scheduler_service.allocation.problem import (
    AllocationProblem,
    BudgetMode,
    BudgetPeriod,
    JobSpec,
    evaluate_gpus,
)
from scheduler_service.allocation.solver import solve

START = datetime(2022, 6, 1, tzinfo=UTC)
SLOT_S = 600.0
# 300 W for one 600 s slot at 400 g/kWh.
ONE_GPU_SLOT_KG = 300.0 * SLOT_S / 3600.0 / 1000.0 * 400.0 / 1000.0


def budget_bound_pair(mode: BudgetMode = BudgetMode.HARD) -> AllocationProblem:
    """Two jobs, one slot, a budget for one GPU-slot per slot.

    `wide` scales to 4 GPUs (fast after the horizon if only capacity mattered) and has 10 %
    less work; `narrow` runs on 1 GPU only. Per sample both cost the same kg at 1 GPU.
    """
    wide = JobSpec("wide", (1, 2, 4), (10.0, 19.0, 36.0), (300.0, 600.0, 1200.0), 54_000.0)
    narrow = JobSpec("narrow", (1,), (10.0,), (300.0,), 60_000.0)
    return AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=(4,),
        intensity_g_per_kwh=(400.0,),
        jobs=(narrow, wide),
        # One period, one slot long: it holds the horizon's end, so its rate (one GPU-slot per
        # slot) is what leftover work is paid at after the horizon.
        budget_periods=(BudgetPeriod(0.0, SLOT_S, ONE_GPU_SLOT_KG * 1.0001),),
        budget_mode=mode,
    )


def test_leftover_budget_rate_is_the_last_periods() -> None:
    problem = budget_bound_pair()
    assert problem.leftover_budget_rate_kg_per_s() == pytest.approx(
        ONE_GPU_SLOT_KG * 1.0001 / SLOT_S
    )
    assert budget_bound_pair(BudgetMode.SOFT).leftover_budget_rate_kg_per_s() is None
    # A budget left of a denormal kg (seen in a randomised run: 5e-324 kg over 2,400 s) divides
    # to a rate of 0.0: it counts as spent (None), never as a rate to divide by.
    spent = dataclasses.replace(problem, budget_periods=(BudgetPeriod(0.0, SLOT_S, 5e-324),))
    assert spent.leftover_budget_rate_kg_per_s() is None
    evaluate_gpus(spent, {"wide": (4,), "narrow": (0,)})


def test_budget_bound_slot_goes_to_the_job_with_least_kg_to_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After the horizon the budget pays one GPU-slot per slot, so jobs finish one after the
    # other at 1 GPU whatever their scaling: running `wide` now (least kg first) gives
    # completions 1+8, 9+10 slots (sum 28); running `narrow` now gives 1+9, 10+9 (sum 29).
    # The in-horizon budget also allows only one GPU-slot, so the plan must pick one of them.
    problem = budget_bound_pair()
    runs_wide: dict[str, tuple[int, ...]] = {"wide": (1,), "narrow": (0,)}
    runs_narrow: dict[str, tuple[int, ...]] = {"wide": (0,), "narrow": (1,)}
    plan = solve(problem, time_limit_s=2.0, seed=0)
    assert plan.gpus == runs_wide
    assert (
        evaluate_gpus(problem, runs_wide).objective < evaluate_gpus(problem, runs_narrow).objective
    )
    # The old tail (leftover at the fastest count, as if the budget did not bind after the
    # horizon) ranks the two the other way: `wide` looks almost done at 4 GPUs.
    monkeypatch.setattr(AllocationProblem, "leftover_budget_rate_kg_per_s", lambda self: None)
    speed_only = budget_bound_pair()
    assert (
        evaluate_gpus(speed_only, runs_narrow).objective
        < evaluate_gpus(speed_only, runs_wide).objective
    )
    assert solve(speed_only, time_limit_s=2.0, seed=0).gpus == runs_narrow
