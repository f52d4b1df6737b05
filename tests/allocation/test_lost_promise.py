"""A promise already lost is still finished as early as the kept promises allow (issue 23).

Once a guaranteed deadline cannot be met even at the job's fastest count, every plan misses it
alike, so the deadline term no longer tells plans apart; weighed like any other job, the late
job then yielded to every shorter one (the fractional completion term finishes short jobs
first) and its lateness grew with the queue. The builder weighs such a job so that a slot of
its delay outweighs delaying every other job for its whole remaining run (`build_problem`).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from scheduler_service.allocation.snapshot import (
    ClusterSnapshot,
    PlannableJob,
    ProblemKnobs,
    build_problem,
    lost_promise_weight,
)
from scheduler_service.allocation.solver import solve

START = datetime(2022, 6, 1, tzinfo=UTC)
SLOT_S = 900.0
COUNTS = (1, 2, 4, 8)
# Samples one slot at 8 GPUs does (linear scaling: 1 sample/s per GPU).
SLOT_AT_8 = 8 * SLOT_S


def _job(
    job_id: str,
    slots_at_8: float,
    deadline_s: float | None = None,
    *,
    running: bool = False,
    best_effort: bool = False,
) -> PlannableJob:
    return PlannableJob(
        job_id=job_id,
        allowed_gpus=COUNTS,
        throughput_samples_per_s=tuple(float(g) for g in COUNTS),
        power_w=tuple(300.0 * g for g in COUNTS),
        remaining_samples=slots_at_8 * SLOT_AT_8,
        deadline_s=deadline_s,
        current_gpus=8 if running else 0,
        started=running,
        best_effort=best_effort,
    )


def _snapshot(*jobs: PlannableJob) -> ClusterSnapshot:
    return ClusterSnapshot(
        start_at=START,
        slot_s=SLOT_S,
        num_slots=6,
        node_gpus=(8,),
        intensity_g_per_kwh=(300.0,) * 6,
        jobs=jobs,
    )


def test_only_a_lost_promise_is_weighed_up() -> None:
    problem = build_problem(
        _snapshot(
            _job("late", 2, deadline_s=-600.0, running=True),
            _job("late_best_effort", 2, deadline_s=-600.0, best_effort=True),
            _job("keepable", 1, deadline_s=900.0),
            _job("free", 1),
        ),
        ProblemKnobs(),
    )
    weights = {job.job_id: job.priority for job in problem.jobs}
    # Two slots at its fastest count; the three others weigh 1 each.
    assert weights["late"] == lost_promise_weight(2 * SLOT_S, 3.0, SLOT_S, 6) == 7.0
    assert weights["late_best_effort"] == weights["keepable"] == weights["free"] == 1.0


def test_a_late_job_is_not_left_behind_shorter_jobs() -> None:
    # Its promise passed 600 s ago and it needs two slots at 8 GPUs; two jobs without a deadline
    # need one each. Weighed like them it ran last (finish 3,600 s, both others first).
    problem = build_problem(
        _snapshot(_job("late", 2, deadline_s=-600.0, running=True), _job("a", 1), _job("b", 1)),
        ProblemKnobs(),
    )
    plan = solve(problem, time_limit_s=1.0, seed=0)
    assert plan.completion_s["late"] == pytest.approx(2 * SLOT_S), plan.gpus


def test_a_late_job_does_not_take_a_promise_still_kept() -> None:
    # "kept" needs the first slot whole to keep its promise: the late job follows it at once.
    problem = build_problem(
        _snapshot(
            _job("late", 2, deadline_s=-600.0, running=True),
            _job("a", 1),
            _job("b", 1),
            _job("kept", 1, deadline_s=SLOT_S),
        ),
        ProblemKnobs(),
    )
    plan = solve(problem, time_limit_s=1.0, seed=0)
    assert plan.deadline_met["kept"], plan.gpus
    assert plan.completion_s["late"] == pytest.approx(3 * SLOT_S), plan.gpus


def test_a_long_late_job_goes_before_many_short_ones() -> None:
    # Four slots of work left against six jobs of a quarter slot each: weighed like them it
    # waited a slot and a half behind them (finish 4,950 s).
    problem = build_problem(
        _snapshot(
            _job("late", 4, deadline_s=-600.0, running=True),
            *(_job(name, 0.25) for name in "abcdef"),
        ),
        ProblemKnobs(),
    )
    plan = solve(problem, time_limit_s=1.0, seed=0)
    assert plan.completion_s["late"] == pytest.approx(4 * SLOT_S), plan.gpus
