"""`solve` keeps its time limit: the steps share one budget, charged with size estimates only."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scheduler_service.allocation.solver as solver_module
from scheduler_service.allocation.problem import AllocationProblem, plan_arrays
from scheduler_service.allocation.solver import plan_steps, solve
from tests.allocation.test_determinism import simulate_tick
from tests.allocation.test_large_properties import large_problems

LIMITS_S = (0.01, 0.05, 0.2, 0.5, 2.0)
FEW = settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@FEW
@given(
    problem=large_problems(),
    time_limit_s=st.sampled_from(LIMITS_S),
    chase=st.booleans(),
)
def test_step_estimates_never_add_up_to_more_than_the_limit(
    problem: AllocationProblem, time_limit_s: float, chase: bool
) -> None:
    steps = plan_steps(problem, plan_arrays(problem), time_limit_s, chase=chase)
    # The first greedy round runs in any case; everything else must fit what it left.
    assert steps.total_s <= time_limit_s + 1e-12 or set(steps.estimates_s) == {"greedy"}
    assert steps.estimates_s.keys() >= {"greedy"}
    assert steps.greedy_rounds == 1 + sum(1 for k in steps.estimates_s if k.startswith("greedy_"))
    # The local search's budget is reserved whole, and only when a pass can fit in it.
    assert (steps.polish_passes > 0) == ("polish" in steps.estimates_s)
    assert steps.estimates_s.get("polish", 0.0) == steps.polish_budget_s


def _spy(
    monkeypatch: pytest.MonkeyPatch,
    calls: Counter[str],
    problem: AllocationProblem,
    budgets_s: list[float],
) -> None:
    """Count the steps `solve` really runs, by the step names of `plan_steps`."""
    real_greedy = solver_module.greedy_plan
    real_lp = solver_module.solve_lp
    real_mip = solver_module.solve_mip
    real_baselines = solver_module.baseline_plans
    real_repair = solver_module.repair_deadlines
    real_polish = solver_module.polish

    def greedy(*args: Any, **kwargs: Any) -> Any:
        calls["chase" if kwargs.get("chase") else "greedy_rounds"] += 1
        return real_greedy(*args, **kwargs)

    def lp(*args: Any, **kwargs: Any) -> Any:
        calls["lp"] += 1
        return real_lp(*args, **kwargs)

    def mip(sub: AllocationProblem, *args: Any, **kwargs: Any) -> Any:
        calls["exact_mip" if sub.num_slots == problem.num_slots else "near_mip"] += 1
        return real_mip(sub, *args, **kwargs)

    def baselines(*args: Any, **kwargs: Any) -> Any:
        calls["baselines"] += 1
        return real_baselines(*args, **kwargs)

    def repair(*args: Any, **kwargs: Any) -> Any:
        calls["repair"] += 1
        calls["repair_trials"] = args[3] if len(args) > 3 else kwargs["max_trials"]
        return real_repair(*args, **kwargs)

    def polish(*args: Any, **kwargs: Any) -> Any:
        calls["polish"] += 1
        calls["polish_passes"] = args[3] if len(args) > 3 else kwargs["passes"]
        budgets_s.append(kwargs["budget_s"])
        return real_polish(*args, **kwargs)

    monkeypatch.setattr(solver_module, "greedy_plan", greedy)
    monkeypatch.setattr(solver_module, "polish", polish)
    monkeypatch.setattr(solver_module, "solve_lp", lp)
    monkeypatch.setattr(solver_module, "solve_mip", mip)
    monkeypatch.setattr(solver_module, "baseline_plans", baselines)
    monkeypatch.setattr(solver_module, "repair_deadlines", repair)


def _check_runs_the_planned_steps(
    problem: AllocationProblem, time_limit_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrays = plan_arrays(problem)
    protect, reserved = solver_module.deadline_reservation(problem, arrays)
    chase = solver_module.needs_chase(problem, arrays, protect, reserved)
    steps = plan_steps(problem, arrays, time_limit_s, chase=chase)
    calls: Counter[str] = Counter()
    budgets_s: list[float] = []
    with monkeypatch.context() as patch:
        _spy(patch, calls, problem, budgets_s)
        solve(problem, time_limit_s=time_limit_s, seed=0)
    assert calls["greedy_rounds"] == steps.greedy_rounds
    assert calls["chase"] == int(steps.chase)
    for name, planned in (
        ("lp", steps.lp),
        ("near_mip", steps.near_mip_slots is not None),
        ("exact_mip", steps.exact_mip),
        ("baselines", steps.baselines),
    ):
        assert calls[name] == int(planned), name
    # The repair runs only when the best plan misses a deadline the LP meets, never with more
    # moves than planned.
    assert calls["repair"] <= int(steps.repair_trials > 0)
    assert calls["repair_trials"] <= steps.repair_trials
    ran = {"greedy"} | {f"greedy_{n}" for n in range(2, calls["greedy_rounds"] + 1)}
    ran |= {name for name in ("lp", "near_mip", "exact_mip", "baselines", "chase") if calls[name]}
    ran |= {"repair"} if calls["repair"] else set()
    # The local search runs at most once (not when no candidate keeps the hard constraints),
    # with the planned passes and budget (its passes are sized inside that budget).
    assert calls["polish"] <= int(steps.polish_passes > 0)
    assert calls["polish_passes"] == (steps.polish_passes if calls["polish"] else 0)
    assert budgets_s == ([steps.polish_budget_s] if calls["polish"] else [])
    ran |= {"polish"} if calls["polish"] else set()
    ran_s = sum(steps.estimates_s[name] for name in ran)
    assert ran_s <= time_limit_s + 1e-12 or ran == {"greedy"}


@pytest.mark.parametrize("time_limit_s", [0.05, 0.5, 2.0])
def test_solve_runs_the_planned_steps_on_a_simulator_tick(
    time_limit_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check_runs_the_planned_steps(simulate_tick(), time_limit_s, monkeypatch)


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(problem=large_problems(), time_limit_s=st.sampled_from(LIMITS_S))
def test_solve_runs_the_planned_steps_at_scale(
    problem: AllocationProblem, time_limit_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check_runs_the_planned_steps(problem, time_limit_s, monkeypatch)
