"""Teams' hard budgets inside the allocation problem (pure: no database)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from scheduler_service.allocation.policies import POLICIES, get_policy
from scheduler_service.allocation.problem import (
    AllocationProblem,
    BudgetPeriod,
    JobSpec,
    TeamBudget,
    cut_to_team_budgets,
    evaluate_gpus,
)

START = datetime(2026, 11, 28, tzinfo=UTC)


def _job(job_id: str, priority: float = 1.0) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        allowed_gpus=(1, 2, 4),
        throughput_samples_per_s=(10.0, 19.0, 36.0),
        power_w=(300.0, 600.0, 1200.0),
        remaining_samples=1e9,  # never finishes inside the horizon
        priority=priority,
    )


def _problem(left_kg: float) -> AllocationProblem:
    # Four one-hour slots at 100 g/kWh: 1 GPU (300 W) for one slot emits 0.03 kg.
    return AllocationProblem(
        start_at=START,
        slot_s=3600.0,
        capacity_gpus=(4,) * 4,
        intensity_g_per_kwh=(100.0,) * 4,
        jobs=(_job("nlp-1", priority=2.0), _job("nlp-2"), _job("vision-1")),
        budget_periods=(BudgetPeriod(start_s=0.0, end_s=4 * 3600.0, budget_left_kg=100.0),),
        team_budgets=(
            TeamBudget(
                team="nlp",
                job_ids=frozenset({"nlp-1", "nlp-2"}),
                periods=(BudgetPeriod(start_s=0.0, end_s=4 * 3600.0, budget_left_kg=left_kg),),
            ),
        ),
    )


def test_the_cut_keeps_the_soonest_slots_and_the_higher_priority_job() -> None:
    problem = _problem(left_kg=0.09)  # three GPU-slots of nlp's jobs
    gpus: dict[str, tuple[int, ...]] = {
        "nlp-1": (2, 2, 2, 2),
        "nlp-2": (1, 1, 1, 1),
        "vision-1": (1, 1, 1, 1),
    }
    cut = cut_to_team_budgets(problem, gpus)
    # The latest slots go first, nlp-2 (lower priority) before nlp-1 in each.
    assert cut == {"nlp-1": (2, 0, 0, 0), "nlp-2": (1, 0, 0, 0), "vision-1": (1, 1, 1, 1)}
    assert evaluate_gpus(problem, cut).budget_ok and not evaluate_gpus(problem, gpus).budget_ok


def test_the_cut_takes_a_teams_jobs_without_a_deadline_before_its_promised_ones() -> None:
    # nlp-2 has a deadline (a promise admission made on the budget the team's deadline jobs
    # leave); nlp-1 has none and the higher priority, yet its GPUs go first, latest slots first.
    base = _problem(left_kg=0.09)
    promised = replace(base.jobs[1], deadline_s=4 * 3600.0)
    problem = replace(base, jobs=(base.jobs[0], promised, base.jobs[2]))
    gpus: dict[str, tuple[int, ...]] = {
        "nlp-1": (2, 2, 2, 2),
        "nlp-2": (1, 1, 1, 1),
        "vision-1": (1, 1, 1, 1),
    }
    cut = cut_to_team_budgets(problem, gpus)
    assert cut == {"nlp-1": (0, 0, 0, 0), "nlp-2": (1, 1, 1, 0), "vision-1": (1, 1, 1, 1)}
    assert evaluate_gpus(problem, cut).budget_ok


def test_every_policy_keeps_a_teams_budget_and_the_others_take_its_gpus() -> None:
    problem = _problem(left_kg=0.0)  # nlp's budget is spent
    for name in POLICIES:
        plan = get_policy(name)(problem, previous=None, time_limit_s=1.0, seed=0)
        assert evaluate_gpus(problem, plan.gpus).budget_ok, name
        assert plan.gpus["nlp-1"] == plan.gpus["nlp-2"] == (0, 0, 0, 0), name
        if name != "static":  # a fixed-size policy runs a job at its requested count only
            assert plan.gpus["vision-1"] == (4, 4, 4, 4), name
    # A policy used without the wrapper is cut all the same (make_plan), GPUs left idle.
    raw = POLICIES["carbon-agnostic"](problem, previous=None, time_limit_s=1.0, seed=0)
    assert raw.gpus["nlp-1"] == raw.gpus["nlp-2"] == (0, 0, 0, 0)
    assert evaluate_gpus(problem, raw.gpus).budget_ok


def test_a_team_over_its_budget_is_planned_again_among_its_own_jobs() -> None:
    # nlp-1 must finish 4 GPU-slots of work (144,000 samples at 10/s per GPU) within the 4 h
    # horizon; nlp's budget pays exactly 4 GPU-slots at one GPU (0.12 kg).
    deadline = replace(
        _job("nlp-1"), remaining_samples=4 * 36_000.0, deadline_s=4 * 3600.0, priority=1.0
    )
    problem = replace(
        _problem(left_kg=0.12),
        jobs=(deadline, _job("nlp-2", priority=2.0), _job("vision-1")),
    )
    greenflow = POLICIES["greenflow"]
    free = greenflow(replace(problem, team_budgets=()), previous=None, time_limit_s=2.0, seed=0)
    cut = cut_to_team_budgets(problem, free.gpus)
    # Cutting the free plan back from its latest slots keeps nlp-1's fastest slot and drops the
    # rest of its work: its deadline is lost.
    assert evaluate_gpus(problem, cut).budget_ok
    assert evaluate_gpus(problem, cut).deadline_met == {"nlp-1": False}
    plan = get_policy("greenflow")(problem, previous=None, time_limit_s=2.0, seed=0)
    planned = evaluate_gpus(problem, plan.gpus)
    # Planned again under the same budget, nlp-1 runs at its most frugal count and makes it.
    assert planned.budget_ok and planned.capacity_ok
    assert planned.deadline_met == {"nlp-1": True}
    assert plan.gpus["nlp-1"] == (1, 1, 1, 1) and plan.gpus["nlp-2"] == (0, 0, 0, 0)
    # The other team takes the GPUs nlp leaves.
    assert all(n >= 2 for n in plan.gpus["vision-1"])
    assert planned.objective < evaluate_gpus(problem, {**free.gpus, **cut}).objective
    assert plan.team_cut == {"nlp-1": "nlp", "nlp-2": "nlp"}
