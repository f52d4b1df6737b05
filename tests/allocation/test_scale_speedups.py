"""The greedy's price curve books what a pick at that price books, and a big problem under a
tiny time limit still gets a whole feasible plan (counts and constraints, not wall-clock)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scheduler_service.allocation.guarded as guarded_module
from scheduler_service.allocation.greedy import UsedCurve, _pick, _used
from scheduler_service.allocation.policies import get_policy
from scheduler_service.allocation.problem import AllocationProblem, JobSpec
from scheduler_service.allocation.solver import solve_with_baselines
from scheduler_service.allocation.steps import guard_edf_fits, guard_resolve_fits
from tests.allocation.test_determinism import simulate_tick
from tests.allocation.test_guarded import count_edf_builds
from tests.allocation.test_properties import SLOT_S, START, check_hard_constraints

COUNT_SETS = [(1,), (1, 2), (2, 4), (1, 2, 4), (1, 2, 4, 8), (2, 4, 8, 16, 32)]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(min_value=0, max_value=2**31), integer_values=st.booleans())
def test_used_curve_books_what_a_pick_books_at_every_price(seed: int, integer_values: bool) -> None:
    rng = np.random.default_rng(seed)
    num_jobs, width = int(rng.integers(1, 40)), 5
    gpus = np.zeros((num_jobs, width))
    valid = np.zeros((num_jobs, width), dtype=bool)
    for j in range(num_jobs):
        counts = COUNT_SETS[int(rng.integers(len(COUNT_SETS)))]
        gpus[j, : len(counts)] = counts
        valid[j, : len(counts)] = True
    allowed = valid & (rng.random((num_jobs, width)) < 0.85)
    if integer_values:  # many exact ties between options
        value = rng.integers(-5, 40, (num_jobs, width)).astype(float)
    else:
        value = rng.normal(10.0, 10.0, (num_jobs, width))
    masked = np.where(allowed, value, -np.inf)
    off_score = np.where(rng.random(num_jobs) < 0.3, -np.inf, rng.choice([0.0, 3.0], num_jobs))
    lo = 1e-9 * float(np.abs(value).max(initial=1.0))
    start = _pick(masked, gpus, off_score, lo)
    curve = UsedCurve(masked, gpus, off_score, start)
    assert curve(lo) == _used(start, gpus)
    # Prices as the greedy's bisection meets them: anywhere above the start's, off the steps.
    for price in [*rng.uniform(lo, 3.0, 40), *rng.uniform(lo, 60.0, 40)]:
        assert curve(float(price)) == _used(_pick(masked, gpus, off_score, float(price)), gpus)


def big_problem(num_jobs: int, num_slots: int, cluster_gpus: int) -> AllocationProblem:
    """Many jobs, a third with deadlines (some impossible), on a cluster they overfill."""
    rng = np.random.default_rng(7)
    jobs = []
    for i in range(num_jobs):
        counts = COUNT_SETS[int(rng.integers(len(COUNT_SETS)))]
        rate = float(rng.uniform(5.0, 50.0))
        throughput = tuple(rate * g ** float(rng.uniform(0.5, 1.0)) for g in counts)
        remaining = max(throughput) * SLOT_S * float(rng.uniform(0.3, 30.0))
        deadline = float(rng.uniform(0.5, 2.0 * num_slots)) * SLOT_S if i % 3 == 0 else None
        jobs.append(
            JobSpec(
                job_id=f"j{i}",
                allowed_gpus=counts,
                throughput_samples_per_s=throughput,
                power_w=tuple(250.0 * g**0.9 for g in counts),
                remaining_samples=remaining,
                deadline_s=deadline,
                priority=float(rng.choice([1.0, 2.0])),
                current_gpus=int(rng.choice((0, *counts))),
            )
        )
    return AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=(cluster_gpus,) * num_slots,
        intensity_g_per_kwh=tuple(float(x) for x in rng.uniform(50.0, 500.0, num_slots)),
        jobs=tuple(jobs),
        change_cost_s=30.0,
    )


def test_a_big_problem_under_a_tiny_limit_gets_a_whole_feasible_plan() -> None:
    problem = big_problem(1500, 96, 256)
    result = solve_with_baselines(problem, time_limit_s=0.001, seed=0)
    # Only the first greedy round fits the limit (by size, not by the clock) ...
    assert [name for name in result.ran if name != "chase"] == ["greedy"]
    # ... and its plan covers every job and slot and keeps capacity and the allowed counts.
    plan = result.plan
    assert set(plan.gpus) == {job.job_id for job in problem.jobs}
    check_hard_constraints(problem, plan.gpus)
    assert sum(1 for counts in plan.gpus.values() if any(counts)) > 0
    # The live policy (guard, stalls, team budgets) keeps them too.
    guarded = get_policy("greenflow")(problem, previous=plan, time_limit_s=0.001, seed=0)
    assert set(guarded.gpus) == set(plan.gpus)
    check_hard_constraints(problem, guarded.gpus)


def test_the_guard_builds_only_what_fits_the_limit_by_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = big_problem(1500, 96, 256)
    assert guard_resolve_fits(simulate_tick(), 0.5) and guard_edf_fits(simulate_tick(), 0.01)
    assert not guard_resolve_fits(problem, 0.5) and not guard_edf_fits(problem, 0.5)
    calls: list[bool] = []
    real = guarded_module.solve_with_baselines

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("previous") is not None)
        return real(*args, **kwargs)

    edf_builds = count_edf_builds(monkeypatch)
    monkeypatch.setattr(guarded_module, "solve_with_baselines", spy)
    previous = solve_with_baselines(problem, time_limit_s=0.5, seed=0).plan
    plan = guarded_module.greenflow(problem, previous=previous, time_limit_s=0.5, seed=0)
    assert any(not ok for ok in plan.deadline_met.values())  # a miss: the re-solve's trigger
    assert calls == [True]  # the warm solve only
    assert edf_builds == []  # and no EDF plan: neither fits the limit at this size
    check_hard_constraints(problem, plan.gpus)
