"""bench/solver_scale.py's step shares: where each tick's plan descends from."""

from __future__ import annotations

from bench.solver_scale import ORTOOLS_STEPS, plan_roots


def test_a_kept_plan_descends_from_the_step_that_built_it() -> None:
    chosen = [
        "lp_ceil+stalls+polish",
        "warm_start",
        "warm_start+polish",
        "greedy_2",
        "warm_start+repair",
        "near_mip",
    ]
    roots = plan_roots(chosen)
    assert roots == ["lp_ceil", "lp_ceil", "lp_ceil", "greedy_2", "greedy_2", "near_mip"]
    assert sum(r in ORTOOLS_STEPS for r in roots) == 4


def test_a_warm_start_with_nothing_before_it_is_its_own_root() -> None:
    # The first tick of a run can only warm-start from a plan the bench did not see.
    assert plan_roots(["warm_start+polish", "warm_start"]) == ["warm_start", "warm_start"]
