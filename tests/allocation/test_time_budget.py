"""`solve` keeps its time limit: the steps share one budget, charged with size estimates only."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.allocation.heuristic import deadline_reservation, needs_chase
from scheduler_service.allocation.problem import AllocationProblem, plan_arrays
from scheduler_service.allocation.solver import solve_with_baselines
from scheduler_service.allocation.steps import plan_steps
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
    # Greedy rounds from the LP's finish times only where the LP runs; the second local search
    # (over the best LP-seeded plan) only with them, on a budget as large as the first's.
    assert steps.lp_greedy_rounds == sum(1 for k in steps.estimates_s if k.startswith("lp_greedy_"))
    assert steps.lp or steps.lp_greedy_rounds == 0
    assert steps.estimates_s.get("lp_polish", 0.0) == steps.lp_polish_budget_s
    assert steps.lp_polish_budget_s in (0.0, steps.polish_budget_s)
    assert steps.lp_greedy_rounds > 0 or steps.lp_polish_budget_s == 0.0


def _check_runs_the_planned_steps(problem: AllocationProblem, time_limit_s: float) -> None:
    arrays = plan_arrays(problem)
    protect, reserved = deadline_reservation(problem, arrays)
    chase = needs_chase(problem, arrays, protect, reserved)
    steps = plan_steps(problem, arrays, time_limit_s, chase=chase)
    ran = solve_with_baselines(problem, time_limit_s=time_limit_s, seed=0).ran
    assert len(ran) == len(set(ran))
    rounds = [name for name in ran if name == "greedy" or name.startswith("greedy_")]
    assert rounds == ["greedy", *(f"greedy_{n}" for n in range(2, steps.greedy_rounds + 1))]
    assert ("chase" in ran) == steps.chase
    for name, planned in (
        ("lp", steps.lp),
        ("near_mip", steps.near_mip_slots is not None),
        ("exact_mip", steps.exact_mip),
        ("baselines", steps.baselines),
        ("lp_greedy", steps.lp_greedy_rounds > 0),
    ):
        assert (name in ran) == planned, name
    # The repair runs only when the best plan misses a deadline the LP meets; the local search
    # at most once (not when no candidate keeps the hard constraints), on its own budget or on
    # the moves the repair's budget paid for and it did not use.
    assert "repair" not in ran or steps.repair_trials > 0
    assert "polish" not in ran or steps.polish_passes > 0 or steps.repair_trials > 0
    charged = set(ran) | ({"repair"} if "polish" in ran and steps.repair_trials > 0 else set())
    ran_s = sum(steps.estimates_s.get(name, 0.0) for name in charged)
    assert ran_s <= time_limit_s + 1e-12 or set(ran) == {"greedy"}


@pytest.mark.parametrize("time_limit_s", [0.05, 0.5, 2.0])
def test_solve_runs_the_planned_steps_on_a_simulator_tick(
    time_limit_s: float,
) -> None:
    _check_runs_the_planned_steps(simulate_tick(), time_limit_s)


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(problem=large_problems(), time_limit_s=st.sampled_from(LIMITS_S))
def test_solve_runs_the_planned_steps_at_scale(
    problem: AllocationProblem, time_limit_s: float
) -> None:
    _check_runs_the_planned_steps(problem, time_limit_s)
