"""A hot switch costs its full stall even when an event cuts the step it started in short."""

from __future__ import annotations

from pathlib import Path

import pytest

from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.allocation.policies import Policy
from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem, make_plan
from scheduler_service.simulate import engine
from scheduler_service.simulate.engine import SimulationConfig, simulate_trace
from scheduler_service.simulate.trace import load_trace
from tests.simulate.test_simulate import write_profiles, write_series, write_trace


def _scripted_policy() -> Policy:
    """Job `a` on 1 GPU at the first call and on 2 GPUs after it; every other job on 1 GPU."""
    calls = {"n": 0}

    def policy(
        problem: AllocationProblem,
        *,
        previous: AllocationPlan | None,
        time_limit_s: float,
        seed: int,
    ) -> AllocationPlan:
        a_gpus = 1 if calls["n"] == 0 else 2
        calls["n"] += 1
        gpus = {
            j.job_id: (a_gpus if j.job_id == "a" else 1,) * problem.num_slots for j in problem.jobs
        }
        return make_plan(problem, gpus, status="baseline", policy="scripted", solve_s=0.0)

    return policy


@pytest.mark.parametrize("other_arrives_at_s", [None, 905, 929])
def test_switch_stall_survives_an_event_during_the_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_arrives_at_s: int | None
) -> None:
    profiles = load_scaling_profiles(write_profiles(tmp_path))
    series = load_intensity_csv(write_series(tmp_path, [100.0] * 48))
    rows = ["a,0,30000,toy,,32,1,1"]
    if other_arrives_at_s is not None:
        rows.append(f"b,{other_arrives_at_s},10,toy,,32,1,1")
    jobs = load_trace(write_trace(tmp_path, rows))
    monkeypatch.setattr(engine, "get_policy", lambda name: _scripted_policy())
    config = SimulationConfig(
        policy="static",
        num_nodes=1,
        gpus_per_node=4,
        switch_s=30.0,
        switch_cost="flat",
        horizon_slots=4,
    )
    report = simulate_trace(jobs, series, profiles, config)
    a = next(o for o in report.outcomes if o.job_id == "a")
    # 900 s at 10 it/s (9,000 iterations), one 30 s switch, the other 21,000 at 18 it/s.
    assert a.finish_s == pytest.approx(900 + 30 + 21_000 / 18)
    assert a.gpu_changes == 1
