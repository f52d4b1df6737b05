"""Spending a binding hard budget: on work rather than timing, in the cleanest slots first.

A job no plan can finish inside the horizon is valued by its work, not its timing; the greedy hands
a binding period budget to its cleanest slots at the jobs' most efficient counts.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import numpy as np
import pytest

from scheduler_service.allocation import greedy
from scheduler_service.allocation.problem import (
    BEYOND_HORIZON_AREA_WEIGHT,
    AllocationProblem,
    BudgetMode,
    BudgetPeriod,
    JobSpec,
    evaluate_gpus,
    horizon_work_bound,
    plan_arrays,
)
from scheduler_service.allocation.slots import SlotState
from scheduler_service.allocation.solver import deadline_reservation, greedy_candidates, solve

START = datetime(2022, 6, 1, tzinfo=UTC)
SLOT_S = 900.0
# Four slots at 400 g/kWh, then four 15 % cleaner ones.
INTENSITY = (400.0,) * 4 + (340.0,) * 4
# One GPU (300 W) for one slot at 340 g/kWh; the budget pays four of them.
ONE_GPU_CLEAN_SLOT_KG = 300.0 * SLOT_S / 3600.0 / 1000.0 * 340.0 / 1000.0
BUDGET_KG = 4.0 * ONE_GPU_CLEAN_SLOT_KG * (1 + 1e-6)
RATE = {0: 0.0, 1: 10.0, 2: 18.0}  # samples/s per GPU count


def problem_with(slots_of_work: float, mode: BudgetMode = BudgetMode.HARD) -> AllocationProblem:
    """One job (1 or 2 GPUs) with `slots_of_work` slots of work at 1 GPU, 8 slots."""
    job = JobSpec("big", (1, 2), (RATE[1], RATE[2]), (300.0, 600.0), slots_of_work * 10.0 * SLOT_S)
    return AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=(2,) * 8,
        intensity_g_per_kwh=INTENSITY,
        jobs=(job,),
        # The period holds the horizon's end: leftover work is paid at its rate after it.
        budget_periods=(BudgetPeriod(0.0, 8 * SLOT_S, BUDGET_KG),),
        budget_mode=mode,
    )


def samples(gpus: tuple[int, ...]) -> float:
    """Samples the job does in a plan (it never finishes inside the horizon here)."""
    return sum(RATE[g] for g in gpus) * SLOT_S


def best_plans(problem: AllocationProblem) -> list[tuple[float, tuple[int, ...]]]:
    """Every plan within the budget, best objective first (brute force)."""
    out = []
    kg_per_w = problem.slot_emissions_kg_per_w()
    for gpus in itertools.product((0, 1, 2), repeat=problem.num_slots):
        # Skip the plans far over the budget without a full evaluation (300 W per GPU).
        if float(np.dot(gpus, kg_per_w)) * 300.0 > BUDGET_KG * 1.01:
            continue
        ev = evaluate_gpus(problem, {"big": gpus})
        if ev.budget_ok:
            out.append((ev.objective, gpus))
    return sorted(out)


def test_budget_goes_to_the_cleanest_slots_when_the_job_cannot_finish() -> None:
    # 4.2 slots of work need more kg than the budget even at 1 GPU in the clean slots, so no plan
    # finishes the job inside the horizon: its completion is past the end whatever runs when.
    problem = problem_with(4.2)
    assert plan_arrays(problem).area_weight.tolist() == [BEYOND_HORIZON_AREA_WEIGHT]
    plan = solve(problem, time_limit_s=2.0, seed=0)
    ev = evaluate_gpus(problem, plan.gpus)
    assert ev.budget_ok and plan.emissions_kg <= BUDGET_KG * (1 + 1e-6)
    # The budget buys four clean GPU-slots: the most work any plan within it does.
    assert plan.gpus["big"] == (0, 0, 0, 0, 1, 1, 1, 1)
    ranked = best_plans(problem)
    assert ranked[0][1] == plan.gpus["big"]
    assert samples(plan.gpus["big"]) == max(samples(g) for _, g in ranked)
    # The bound that classed the job is an upper bound on the work of every plan in the budget
    # (here it is met: four clean slots at 1 GPU).
    bound = horizon_work_bound(problem, plan_arrays(problem))[0]
    assert max(samples(g) for _, g in ranked) <= bound * (1 + 1e-9)
    assert bound == pytest.approx(samples(plan.gpus["big"]), rel=1e-5)
    # With the full completion area (the old objective) the best plan spends the budget in the
    # first, dirtier slots: work early counted at every later slot end although the job
    # finishes after the horizon anyway, and it buys 25 % less work for the same budget.
    plan_arrays(problem).area_weight = np.ones(1)
    old_best = best_plans(problem)[0][1]
    assert old_best == (1, 1, 1, 0, 0, 0, 0, 0)
    assert samples(old_best) < 0.8 * samples(plan.gpus["big"])


def test_jobs_that_can_finish_keep_the_full_area() -> None:
    # Two slots of work fit the budget, so when it finishes inside the horizon counts.
    assert plan_arrays(problem_with(2.0)).area_weight.tolist() == [1.0]
    # Soft budgets bind nothing, so nothing is known to finish after the horizon.
    soft = problem_with(4.2, BudgetMode.SOFT)
    assert plan_arrays(soft).area_weight.tolist() == [1.0]


def old_split_reserve(
    problem: AllocationProblem, state: SlotState, reserved: np.ndarray | None = None
) -> np.ndarray | None:
    """The greedy's previous budget split: each period over its slots by 1 / intensity^2."""
    weight = 1.0 / np.asarray(problem.intensity_g_per_kwh, dtype=float) ** 2
    out = np.zeros((len(state.periods), problem.num_slots))
    for n, (period, share) in enumerate(state.periods):
        mass = weight * share
        out[n] = period.budget_left_kg * (np.cumsum(mass[::-1])[::-1] - mass) / mass.sum()
    return out


def greedy_work(problem: AllocationProblem) -> tuple[float, float, bool]:
    """(samples, kg, within every period's budget) of the greedy's first-round plan."""
    arrays = plan_arrays(problem)
    protect, reserved = deadline_reservation(problem, arrays)
    gpus, ev = greedy_candidates(problem, arrays, None, None, 1, reservation=(protect, reserved))[0]
    done = 0.0
    for job in problem.jobs:
        rates = dict(zip(job.allowed_gpus, job.throughput_samples_per_s, strict=True))
        work = sum(rates.get(g, 0.0) for g in gpus[job.job_id]) * problem.slot_s
        done += min(work, job.remaining_samples)
    return done, float(ev.emissions_kg_per_slot.sum()), ev.budget_ok


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_budget_buys_more_work_per_kg_than_the_intensity_split(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Six jobs with 1-8 GPU counts (throughput sublinear, power linear in GPUs), 16 slots of a
    # noisy day curve, two periods whose budgets pay for about a third of the efficient work.
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(6):
        base = float(rng.uniform(5.0, 20.0))
        counts = (1, 2, 4, 8)
        jobs.append(
            JobSpec(
                f"j{i}",
                counts,
                tuple(base * g**0.8 for g in counts),
                tuple(280.0 * g for g in counts),
                base * SLOT_S * float(rng.uniform(20.0, 60.0)),
            )
        )
    intensity = tuple(
        float(x) for x in 250 + 80 * np.cos(np.arange(16) / 16 * 2 * np.pi) + rng.uniform(0, 30, 16)
    )
    kg_per_w = np.asarray(intensity) * SLOT_S / 3600.0 / 1000.0 / 1000.0
    # What every job at 1 GPU would draw over each half of the horizon, a third of it each.
    half_kg = [float(280.0 * 6 * kg_per_w[a : a + 8].sum()) / 3 for a in (0, 8)]
    problem = AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=(16,) * 16,
        intensity_g_per_kwh=intensity,
        jobs=tuple(jobs),
        budget_periods=(
            BudgetPeriod(0.0, 8 * SLOT_S, half_kg[0]),
            BudgetPeriod(8 * SLOT_S, 16 * SLOT_S, half_kg[1]),
        ),
        budget_mode=BudgetMode.HARD,
    )
    new_samples, new_kg, new_ok = greedy_work(problem)
    monkeypatch.setattr(greedy, "budget_reserve", old_split_reserve)
    old_samples, old_kg, old_ok = greedy_work(problem)
    assert new_ok and old_ok
    assert new_kg <= sum(half_kg) * (1 + 1e-6)
    assert new_samples / new_kg > 1.05 * old_samples / old_kg
    assert new_samples > old_samples
