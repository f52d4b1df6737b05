"""The solver's plan depends on the problem, the time limit and the seed, never on the clock."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

import scheduler_service.allocation.solver as solver_module
from scheduler_service.allocation.guarded import greenflow
from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    BudgetMode,
    JobSpec,
    make_plan,
)
from scheduler_service.allocation.solver import solve_with_baselines

START = datetime(2021, 1, 24, 7, 33, tzinfo=UTC)
SLOT_S = 900.0
COUNTS = (1, 2, 4, 8, 16)


def _job(
    job_id: str,
    rates: tuple[float, ...],
    power_w: tuple[float, ...],
    samples: float,
    deadline_s: float,
    current: int,
) -> JobSpec:
    return JobSpec(job_id, COUNTS, rates, power_w, samples, deadline_s, current_gpus=current)


def simulate_tick() -> AllocationProblem:
    """A tick of `greenflow simulate --limit 20 --cluster 2x8` (ITP cluster01, CAISO) where runs
    diverged: six deadline jobs within three slots, 48 slots, soft mode, 30 s switch cost."""
    bert = (323.4, 578.3, 944.3, 1237.1, 1657.2), (306.0, 563.7, 975.4, 1469.8, 2311.1)
    resnet = (1048.9, 1781.7, 2928.8, 4007.8, 4575.3), (306.0, 543.1, 945.4, 1468.7, 2115.8)
    vgg = (935.5, 1529.1, 2133.3, 2394.1, 2544.0), (306.0, 528.3, 823.9, 1154.7, 1682.1)
    gpt = (471.9, 882.8, 1584.8, 2656.9, 3879.1), (306.0, 582.6, 1077.2, 1901.6, 3078.1)
    jobs = (
        _job("a", *bert, 218_932.0, 907.0, 2),
        _job("b", *resnet, 842_501.0, 2034.0, 4),
        _job("c", *resnet, 1_256_987.0, 1965.0, 4),
        _job("d", *vgg, 1_264_137.0, 1509.0, 2),
        _job("e", *bert, 490_334.0, 1695.0, 4),
        _job("f", *gpt, 810_496.0, 1140.0, 0),
    )
    intensity = tuple(285.0 - 2.0 * (t % 24) + 1.5 * (t // 24) for t in range(48))
    return AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=(16,) * 48,
        intensity_g_per_kwh=intensity,
        jobs=jobs,
        budget_mode=BudgetMode.SOFT,
        change_cost_s=30.0,
    )


def _same(a: AllocationPlan, b: AllocationPlan) -> None:
    assert a.gpus == b.gpus
    assert a.objective == b.objective and a.status == b.status and a.bound == b.bound


def _load_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The solver's clock as on a machine so loaded that each reading is 10 s after the last."""
    ticks = itertools.count(step=10.0)
    monkeypatch.setattr(solver_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))


def previous_plan(problem: AllocationProblem) -> AllocationPlan:
    """The plan of the tick 55 s before: jobs a-e at their current counts, then idle."""
    before = replace(problem, start_at=START - timedelta(seconds=55), jobs=problem.jobs[:5])
    gpus: dict[str, tuple[int, ...]] = {
        j.job_id: (j.current_gpus,) + (0,) * 47 for j in before.jobs
    }
    return make_plan(before, gpus, status="heuristic", policy="greenflow", solve_s=0.0)


@pytest.mark.parametrize(("time_limit_s", "warm"), [(0.5, True), (0.5, False), (2.0, True)])
def test_plan_is_the_same_on_a_loaded_machine(
    time_limit_s: float, warm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    problem = simulate_tick()
    previous = previous_plan(problem) if warm else None
    quiet = solve_with_baselines(problem, previous=previous, time_limit_s=time_limit_s, seed=0)
    assert "near_mip" in quiet.ran  # the near-deadline MIP runs on this tick
    _load_the_machine(monkeypatch)
    loaded = solve_with_baselines(problem, previous=previous, time_limit_s=time_limit_s, seed=0)
    assert loaded.ran == quiet.ran  # the same steps ran, though the clock said time was up
    _same(quiet.plan, loaded.plan)


def test_guarded_policy_is_repeatable_under_load(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = simulate_tick()
    previous = previous_plan(problem)
    quiet = greenflow(problem, previous=previous, time_limit_s=0.5, seed=0)
    again = greenflow(problem, previous=previous, time_limit_s=0.5, seed=0)
    _load_the_machine(monkeypatch)
    loaded = greenflow(problem, previous=previous, time_limit_s=0.5, seed=0)
    _same(quiet, again)
    _same(quiet, loaded)
