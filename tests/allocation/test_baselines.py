"""Each baseline's defining behaviour on hand-made problems."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from scheduler_service.allocation.baselines import (
    carbon_agnostic,
    carbon_greedy,
    lean_edf,
    static_fcfs,
    temporal_shift,
)
from scheduler_service.allocation.guarded import greenflow
from scheduler_service.allocation.problem import AllocationProblem, JobSpec
from scheduler_service.allocation.solver import solve

START = datetime(2022, 6, 1, tzinfo=UTC)
SLOT_S = 3600.0
DIRTY_CLEAN = (500.0, 500.0, 50.0, 50.0, 500.0, 500.0)


def job(
    job_id: str, slots_at_one_gpu: float, deadline_slots: float | None = None, **kw: object
) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        allowed_gpus=(1, 2, 4),
        throughput_samples_per_s=(10.0, 18.0, 30.0),
        power_w=(300.0, 560.0, 1000.0),
        remaining_samples=10.0 * SLOT_S * slots_at_one_gpu,
        deadline_s=None if deadline_slots is None else deadline_slots * SLOT_S,
        **kw,  # type: ignore[arg-type]
    )


def problem(*jobs: JobSpec, capacity: int = 4) -> AllocationProblem:
    return AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=(capacity,) * len(DIRTY_CLEAN),
        intensity_g_per_kwh=DIRTY_CLEAN,
        jobs=jobs,
    )


def test_shift_starts_in_the_cleanest_window_that_meets_the_deadline() -> None:
    free = temporal_shift(problem(job("a", 2.0, requested_gpus=1)))
    assert free.gpus["a"] == (0, 0, 1, 1, 0, 0)
    tight = temporal_shift(problem(job("a", 2.0, deadline_slots=2.0, requested_gpus=1)))
    assert tight.gpus["a"] == (1, 1, 0, 0, 0, 0)


def test_carbon_greedy_buys_clean_slots_first() -> None:
    plan = carbon_greedy(problem(job("a", 2.0)))
    assert plan.gpus["a"][0] == plan.gpus["a"][1] == 0
    assert plan.completion_s["a"] is not None and plan.completion_s["a"] <= 4 * SLOT_S


def test_static_is_first_come_first_served_at_the_largest_count() -> None:
    plan = static_fcfs(problem(job("a", 4.0), job("b", 1.0)))
    # a takes all 4 GPUs until it finishes (4 slots of work at 30/10 = 3x speed: 1h20m), then b.
    assert plan.gpus["a"][:2] == (4, 4) and plan.gpus["b"][0] == 0
    assert plan.gpus["b"][2] == 4


def test_carbon_agnostic_gives_deadline_jobs_their_minimum_share_first() -> None:
    plan = carbon_agnostic(problem(job("late", 10.0), job("urgent", 3.0, deadline_slots=2.0)))
    # urgent needs 15 samples/s for 2 slots: 2 GPUs (18/s) is its minimum share.
    assert plan.gpus["urgent"][0] >= 2
    assert plan.deadline_met == {"urgent": True}
    assert plan.gpus["late"][0] + plan.gpus["urgent"][0] <= 4


def test_lean_edf_meets_deadlines_without_filling_spare_gpus() -> None:
    plan = lean_edf(problem(job("free", 2.0), job("urgent", 3.0, deadline_slots=2.0)))
    # urgent at its minimum share (2 GPUs); free at its most efficient count, 1 GPU
    # (300/10 = 30 J per sample against 560/18 = 31.1 J and 1000/30 = 33.3 J).
    assert plan.gpus["urgent"][0] == 2 and plan.gpus["free"][0] == 1
    assert plan.deadline_met == {"urgent": True}
    # ElasticFlow fills the spare GPU instead: more energy for the same deadline.
    filled = carbon_agnostic(problem(job("free", 2.0), job("urgent", 3.0, deadline_slots=2.0)))
    assert filled.deadline_met == {"urgent": True} and filled.energy_kwh > plan.energy_kwh


def test_the_solver_alone_is_never_worse_than_the_edf_baselines_on_the_objective() -> None:
    jobs = (job("a", 3.0, deadline_slots=2.0), job("b", 2.0, deadline_slots=3.0), job("c", 4.0))
    for price in (0.0, 200_000.0):
        p = replace(problem(*jobs), carbon_price_s_per_kg=price)
        # Without the baselines as candidates (the guard and `solve` add them, which would
        # make this hold by construction).
        plan = solve(p, time_limit_s=5.0, seed=0, use_baselines=False)
        assert plan.policy == "greenflow" and not plan.step.startswith("baseline")
        for baseline in (lean_edf, carbon_agnostic):
            assert plan.objective <= baseline(p).objective + 1e-6
        assert greenflow(p, previous=None, time_limit_s=5.0, seed=0).objective <= plan.objective
