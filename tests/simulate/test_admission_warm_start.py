"""The tick after an admission warm-starts from the plan that admitted the job.

Why: admission solves at half the tick's time limit, and `solve` picks its steps by size and
limit, so the tick's own solve can miss a plan admission found; measured on the first 100 ITP
cluster01 jobs (2x8, CAISO, 900 s slots): two admitted jobs then missed their deadlines.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

import scheduler_service.allocation.policies as policies
from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem
from scheduler_service.simulate.engine import SimulationConfig, simulate_trace
from scheduler_service.simulate.trace import load_trace
from tests.simulate.test_simulate import write_profiles, write_series, write_trace

Call = tuple[frozenset[str], AllocationPlan | None, AllocationPlan, float]


@pytest.mark.parametrize("elasticflow_events", [False, True])
def test_the_tick_after_an_admission_starts_from_the_admitting_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, elasticflow_events: bool
) -> None:
    calls: list[Call] = []
    real = policies.POLICIES["greenflow"]

    def recording(problem: AllocationProblem, **kwargs: Any) -> AllocationPlan:
        plan = real(problem, **kwargs)
        calls.append(
            (
                frozenset(j.job_id for j in problem.jobs),
                kwargs.get("previous"),
                plan,
                kwargs["time_limit_s"],
            )
        )
        return plan

    monkeypatch.setitem(policies.POLICIES, "greenflow", recording)
    profiles = load_scaling_profiles(write_profiles(tmp_path))  # toy: 10 it/s on 1 GPU
    series = load_intensity_csv(write_series(tmp_path, [100.0] * 24))
    jobs = load_trace(
        write_trace(
            tmp_path,
            [
                "first,0,36000,toy,8000,32,1,3600",  # runs past 1,000 s
                "second,1000,3600,toy,5000,32,1,360",  # arrives while "first" runs
                "third,1000,3000,toy,6000,32,1,300",
            ],
        )
    )
    config = SimulationConfig(
        "greenflow",
        1,
        4,
        slot_s=900.0,
        horizon_slots=8,
        time_limit_s=0.2,
        elasticflow_events=elasticflow_events,
    )
    report = simulate_trace(jobs, series, profiles, config)
    assert all(o.admitted and o.deadline_met for o in report.outcomes)
    # Ticks are the calls at the full time limit (admission solves at half of it). A tick that
    # sees a job the tick before it did not see follows that job's admission, whose last solve
    # (the call just before the tick) planned every job admitted so far: the tick must start
    # from it.
    ticks = [i for i, call in enumerate(calls) if call[3] == config.time_limit_s]
    after_admission = [
        i for before, i in itertools.pairwise(ticks) if calls[i][0] - calls[before][0]
    ]
    assert after_admission  # "second" and "third" join while "first" runs
    for i in after_admission:
        assert calls[i][1] is calls[i - 1][2]
        assert calls[i - 1][0] == calls[i][0]
