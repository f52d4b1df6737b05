"""The Lagrangian bound on whole-slot plans (bench/bounds/integer.py) against brute force."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.bounds.integer import integer_bound
from scheduler_service.allocation.problem import AllocationProblem
from tests.allocation.test_properties import brute_force, problems

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _impossible(problem: AllocationProblem) -> int:
    return sum(1 for j in problem.jobs if problem.deadline_impossible(j))


@SETTINGS
@given(
    problem=problems(max_jobs=2, max_slots=3),
    prices=st.lists(st.floats(min_value=0.0, max_value=5e3), min_size=3, max_size=3),
)
def test_bound_is_below_the_best_plan(problem: AllocationProblem, prices: list[float]) -> None:
    misses, best = brute_force(problem)
    # The bound keeps every deadline that can be met as a constraint: valid when the best plan
    # meets them all (the bench only uses it then).
    if misses != _impossible(problem) or not np.isfinite(best):
        return
    best_rest = best - problem.deadline_miss_cost_s() * misses
    lam = np.array(prices[: problem.num_slots])
    bound, _ = integer_bound(problem, lam, best_rest, grid=200, steps=3)
    assert bound <= best_rest + 1e-6 * max(1.0, abs(best_rest))


@SETTINGS
@given(problem=problems(max_jobs=1, max_slots=3))
def test_bound_is_tight_for_one_job_without_contention(problem: AllocationProblem) -> None:
    # One job, room for its largest count in every slot, no change cost, no budget: at price 0
    # the bound is the job's best plan up to the grid's rounding of work.
    problem = dataclasses.replace(
        problem,
        capacity_gpus=(max(problem.jobs[0].allowed_gpus),) * problem.num_slots,
        budget_periods=(),
        change_cost_s=0.0,
    )
    misses, best = brute_force(problem)
    if misses != _impossible(problem):
        return
    best_rest = best - problem.deadline_miss_cost_s() * misses
    bound, _ = integer_bound(problem, np.zeros(problem.num_slots), best_rest, grid=4000, steps=1)
    assert bound <= best_rest + 1e-6 * max(1.0, abs(best_rest))
    assert bound >= best_rest - 0.01 * max(1.0, abs(best_rest))
