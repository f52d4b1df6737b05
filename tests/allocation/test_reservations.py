"""Deadline reservations under overload: valid, and the best of the orders tried."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
from hypothesis import HealthCheck, given, settings

from scheduler_service.allocation.greedy import (
    best_reservation,
    effective_deadlines,
    overload_orders,
    reserve_deadlines,
    slot_durations,
)
from scheduler_service.allocation.problem import AllocationProblem, JobSpec, plan_arrays
from tests.allocation.test_large_properties import large_problems

SLOT_S = 1800.0
COUNTS = (1, 2, 4, 8)


def _protectable(problem: AllocationProblem) -> np.ndarray:
    return np.array(
        [j.deadline_s is not None and not problem.deadline_impossible(j) for j in problem.jobs]
    )


def _job(job_id: str, deadline_s: float, samples: float, rates: tuple[float, ...]) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        allowed_gpus=COUNTS,
        throughput_samples_per_s=rates,
        power_w=tuple(300.0 * g for g in COUNTS),
        remaining_samples=samples,
        deadline_s=deadline_s,
    )


def test_a_narrow_deadline_placed_first_lets_a_wide_one_run_faster_later() -> None:
    # 8 GPUs. "narrow" (due at 900 s) and "wide-8" (due at 4,500 s) each need all 8 GPUs in the
    # first slot, so at most one of them fits. "flex" (due at 5,400 s) covers its work at 4
    # GPUs over all three slots or at 8 GPUs in the last slot plus 1 GPU before it. Latest
    # deadline first, fewest GPUs on average and fewest GPU-slots per window slot all place
    # "flex" first, at 4 GPUs in every slot, after which neither 8-GPU job fits: 1 protected.
    # By the GPU count of each job's own cheapest reservation (8 for all three; ties go to the
    # earlier deadline) "narrow" goes first and "flex" then fits at 8 GPUs late: 2.
    problem = AllocationProblem(
        start_at=datetime(2021, 1, 1, tzinfo=UTC),
        slot_s=SLOT_S,
        capacity_gpus=(8, 8, 8),
        intensity_g_per_kwh=(200.0, 200.0, 200.0),
        jobs=(
            _job("flex", 5400.0, 1_074_000, (100.0, 169.0, 245.0, 557.0)),
            _job("narrow", 900.0, 504_000, (100.0, 199.0, 273.0, 645.0)),
            _job("wide-8", 4500.0, 1_741_000, (100.0, 176.0, 249.0, 478.0)),
        ),
    )
    arrays = plan_arrays(problem)
    protect = _protectable(problem)
    assert protect.all()
    by_deadline = reserve_deadlines(problem, arrays, protect)[1]
    assert by_deadline.tolist() == [True, False, False]
    kept = [
        reserve_deadlines(problem, arrays, protect, o)[1].tolist()
        for o in overload_orders(problem, arrays, protect)
    ]
    assert kept == [[True, False, False], [True, False, False], [True, True, False]]
    reserved = best_reservation(problem, arrays, protect)
    assert (reserved >= 0).any(axis=1).tolist() == [True, True, False]
    assert arrays.gpus[1, reserved[1, 0]] == 8  # "narrow" holds the whole first slot
    assert reserved[0, 0] == -1  # "flex" is off there


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(problem=large_problems())
def test_the_chosen_reservation_fits_covers_and_keeps_the_most_of_every_order(
    problem: AllocationProblem,
) -> None:
    arrays = plan_arrays(problem)
    protect = _protectable(problem)
    reserved = best_reservation(problem, arrays, protect)
    rows = np.arange(arrays.num_jobs)[:, None]
    on = reserved >= 0
    gpus = np.where(on, arrays.gpus[rows, np.maximum(reserved, 0)], 0)
    assert (gpus.sum(axis=0) <= np.asarray(problem.capacity_gpus)).all()
    # Every protected job's reservation covers its work before its deadline, and only
    # protectable jobs hold one.
    end_s, need = effective_deadlines(problem, arrays)
    done = (
        np.where(on, arrays.throughput[rows, np.maximum(reserved, 0)], 0.0)
        * slot_durations(problem, end_s)
    ).sum(axis=1)
    kept = on.any(axis=1)
    assert (done[kept] >= need[kept] * (1 - 1e-6)).all()
    assert not (kept & ~protect).any()
    counts = [reserve_deadlines(problem, arrays, protect)[1].sum()] + [
        reserve_deadlines(problem, arrays, protect, o)[1].sum()
        for o in overload_orders(problem, arrays, protect)
    ]
    assert kept.sum() == max(counts)
