"""Property tests on small random problems: hard constraints, brute-force optimality, baselines."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.allocation.highs import solve_lp
from scheduler_service.allocation.policies import POLICIES
from scheduler_service.allocation.problem import (
    BUDGET_TAIL_MAX_SLOTS,
    AllocationProblem,
    BudgetMode,
    BudgetPeriod,
    JobSpec,
    PlanArrays,
    evaluate_gpus,
    leftover_kg_per_fraction,
)
from scheduler_service.allocation.solver import solve

START = datetime(2022, 6, 1, tzinfo=UTC)
SLOT_S = 600.0
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@st.composite
def jobs(draw: st.DrawFn, index: int, num_slots: int) -> JobSpec:
    counts = draw(st.sampled_from([(1,), (1, 2), (2,), (1, 2, 4), (2, 4)]))
    base = draw(st.floats(min_value=5.0, max_value=50.0))
    exponent = draw(st.floats(min_value=0.5, max_value=1.0))
    throughput = tuple(base * g**exponent for g in counts)
    watts = draw(st.floats(min_value=100.0, max_value=400.0))
    power = tuple(watts * g**0.9 for g in counts)
    # Work for 0.3-3 slots at the fastest count, so finishing inside the horizon is possible.
    remaining = max(throughput) * SLOT_S * draw(st.floats(min_value=0.3, max_value=3.0))
    deadline = draw(
        st.one_of(
            st.none(), st.floats(min_value=0.2, max_value=num_slots + 0.5).map(lambda s: s * SLOT_S)
        )
    )
    current = draw(st.sampled_from((0, *counts)))
    return JobSpec(
        job_id=f"job{index}",
        allowed_gpus=counts,
        throughput_samples_per_s=throughput,
        power_w=power,
        remaining_samples=remaining,
        deadline_s=deadline,
        priority=draw(st.sampled_from([1.0, 2.0])),
        current_gpus=current,
    )


@st.composite
def problems(draw: st.DrawFn, max_jobs: int = 2, max_slots: int = 3) -> AllocationProblem:
    num_slots = draw(st.integers(min_value=1, max_value=max_slots))
    num_jobs = draw(st.integers(min_value=1, max_value=max_jobs))
    capacity = tuple(draw(st.integers(min_value=0, max_value=5)) for _ in range(num_slots))
    intensity = tuple(draw(st.floats(min_value=20.0, max_value=600.0)) for _ in range(num_slots))
    mode = draw(st.sampled_from([BudgetMode.HARD, BudgetMode.SOFT]))
    periods: tuple[BudgetPeriod, ...] = ()
    if draw(st.booleans()):
        budget_kg = draw(st.floats(min_value=0.0, max_value=1.0))
        periods = (BudgetPeriod(start_s=0.0, end_s=num_slots * SLOT_S, budget_left_kg=budget_kg),)
    return AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=capacity,
        intensity_g_per_kwh=intensity,
        jobs=tuple(draw(jobs(i, num_slots)) for i in range(num_jobs)),
        budget_periods=periods,
        budget_mode=mode,
        carbon_price_s_per_kg=draw(st.sampled_from([0.0, 500.0])),
        change_cost_s=1.0,
    )


def brute_force(problem: AllocationProblem) -> tuple[int, float]:
    """(fewest deadline misses, best objective) over every feasible plan."""
    per_job = []
    for job in problem.jobs:
        per_job.append(list(itertools.product((0, *job.allowed_gpus), repeat=problem.num_slots)))
    best_misses, best_objective = 10**9, float("inf")
    for combo in itertools.product(*per_job):
        gpus = {job.job_id: counts for job, counts in zip(problem.jobs, combo, strict=True)}
        ev = evaluate_gpus(problem, gpus)
        if not (ev.capacity_ok and ev.allowed_ok and ev.budget_ok):
            continue
        misses = sum(1 for ok in ev.deadline_met.values() if not ok)
        best_misses = min(best_misses, misses)
        best_objective = min(best_objective, ev.objective)
    return best_misses, best_objective


def check_hard_constraints(problem: AllocationProblem, gpus: dict[str, tuple[int, ...]]) -> None:
    used = [0] * problem.num_slots
    for job in problem.jobs:
        counts = gpus[job.job_id]
        assert len(counts) == problem.num_slots
        for t, g in enumerate(counts):
            assert g == 0 or g in job.allowed_gpus, f"{job.job_id} slot {t}: {g} not allowed"
            used[t] += g
    for t in range(problem.num_slots):
        assert used[t] <= problem.capacity_gpus[t], f"slot {t} over capacity"
    if problem.budget_mode is BudgetMode.HARD:
        # Per period: the emissions of the slots (or parts of slots) inside it, from slot power.
        kg_per_w = problem.slot_emissions_kg_per_w()
        power_w = [0.0] * problem.num_slots
        for job in problem.jobs:
            for t, g in enumerate(gpus[job.job_id]):
                if g:
                    power_w[t] += job.power_w[job.allowed_gpus.index(g)]
        for period in problem.budget_periods:
            kg = 0.0
            for t in range(problem.num_slots):
                start_s, end_s = t * problem.slot_s, (t + 1) * problem.slot_s
                inside_s = max(0.0, min(end_s, period.end_s) - max(start_s, period.start_s))
                kg += power_w[t] * kg_per_w[t] * inside_s / problem.slot_s
            assert kg <= period.budget_left_kg * (1 + 1e-6) + 1e-9, f"period {period} over budget"


@pytest.mark.parametrize("name", sorted(POLICIES))
@SETTINGS
@given(problem=problems(max_jobs=4, max_slots=5))
def test_every_policy_keeps_hard_constraints(name: str, problem: AllocationProblem) -> None:
    plan = POLICIES[name](problem, previous=None, time_limit_s=10.0, seed=0)
    check_hard_constraints(problem, plan.gpus)
    assert plan.objective == pytest.approx(evaluate_gpus(problem, plan.gpus).objective)


@SETTINGS
@given(problem=problems())
def test_solver_matches_brute_force(problem: AllocationProblem) -> None:
    best_misses, best_objective = brute_force(problem)
    plan = solve(problem, time_limit_s=10.0, seed=0)
    misses = sum(1 for ok in plan.deadline_met.values() if not ok)
    # Deadlines are met whenever some plan meets them, and the plan is optimal on the objective.
    assert misses == best_misses
    assert plan.objective <= best_objective * (1 + 1e-5) + 1e-6
    assert set(plan.missed_reasons) == {k for k, ok in plan.deadline_met.items() if not ok}
    # The compact LP is a relaxation: its value never exceeds the best integer plan's.
    lp = solve_lp(problem, PlanArrays(problem))
    assert lp.bound <= best_objective * (1 + 1e-6) + 1e-6


@SETTINGS
@given(problem=problems(max_jobs=3, max_slots=4))
def test_solver_never_worse_than_a_baseline(problem: AllocationProblem) -> None:
    # Without the baselines among its candidates: the solver's own steps (the exact MIP at this
    # size) must find a plan at least as good as every baseline's.
    plan = solve(problem, time_limit_s=10.0, seed=0, use_baselines=False)
    for name, policy in POLICIES.items():
        if name == "greenflow":
            continue
        other = policy(problem, previous=None, time_limit_s=10.0, seed=0)
        assert plan.objective <= other.objective * (1 + 1e-5) + 1e-6, name


@SETTINGS
@given(problem=problems(max_jobs=8, max_slots=6))
def test_heuristic_alone_keeps_hard_constraints(problem: AllocationProblem) -> None:
    # The path large problems take (no LP, no MIP) must keep every hard constraint too.
    plan = solve(problem, time_limit_s=10.0, seed=0, use_lp=False)
    check_hard_constraints(problem, plan.gpus)
    assert plan.bound is None and plan.gap is None
    assert plan.objective == pytest.approx(evaluate_gpus(problem, plan.gpus).objective)


@SETTINGS
@given(problem=problems(max_jobs=5, max_slots=5))
def test_heuristic_meets_a_lone_deadline_whenever_it_can_be_met(
    problem: AllocationProblem,
) -> None:
    # One deadline job among jobs without deadlines, no budget: the reservation must meet it
    # whenever the job alone (brute force) can meet it on this capacity.
    first, *others = problem.jobs
    if first.deadline_s is None:
        first = replace(first, deadline_s=SLOT_S * 1.5)
    problem = replace(
        problem,
        jobs=(first, *(replace(j, deadline_s=None) for j in others)),
        budget_periods=(),
        budget_mode=BudgetMode.SOFT,
    )
    alone_misses, _ = brute_force(replace(problem, jobs=(first,)))
    plan = solve(problem, time_limit_s=10.0, seed=0, use_lp=False)
    if alone_misses == 0:
        assert plan.deadline_met[first.job_id]
    check_hard_constraints(problem, plan.gpus)


@pytest.mark.parametrize("use_lp", [None, False])
def test_solver_is_deterministic_for_a_seed(use_lp: bool | None) -> None:
    problem = _fixed_problem()
    first = solve(problem, time_limit_s=10.0, seed=3, use_lp=use_lp)
    second = solve(problem, time_limit_s=10.0, seed=3, use_lp=use_lp)
    assert first.gpus == second.gpus


def _fixed_problem() -> AllocationProblem:
    jobs = tuple(
        JobSpec(
            job_id=f"j{i}",
            allowed_gpus=(1, 2, 4),
            throughput_samples_per_s=(10.0 + i, 18.0 + i, 30.0 + i),
            power_w=(250.0, 480.0, 900.0),
            remaining_samples=(10.0 + i) * SLOT_S * (1 + i % 3),
            deadline_s=SLOT_S * (2 + i) if i % 2 else None,
        )
        for i in range(6)
    )
    return AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=(6, 6, 4, 4, 8, 8),
        intensity_g_per_kwh=(300.0, 250.0, 100.0, 90.0, 400.0, 450.0),
        jobs=jobs,
    )


def budget_waiting_slots(problem: AllocationProblem) -> dict[str, float]:
    """Loop version of the budget-aware tail: per job, slots of weighted waiting per leftover
    fraction when leftover work is paid at the last period's rate, least kg served first."""
    rate = problem.leftover_budget_rate_kg_per_s()
    if rate is None:
        return {job.job_id: 0.0 for job in problem.jobs}
    kg = [leftover_kg_per_fraction(problem, job) for job in problem.jobs]
    out = {}
    for i, job in enumerate(problem.jobs):
        # Served at or after job i: more kg, or as much and later in the job list.
        behind = sum(
            other.priority
            for n, other in enumerate(problem.jobs)
            if kg[n] > kg[i] or (kg[n] == kg[i] and n >= i)
        )
        slots = kg[i] * behind / (rate * job.priority * problem.slot_s)
        out[job.job_id] = min(slots, BUDGET_TAIL_MAX_SLOTS)
    return out


def reference_evaluation(
    problem: AllocationProblem, gpus: dict[str, tuple[int, ...]]
) -> tuple[float, dict[str, float | None], int, bool]:
    """Slot-by-slot loop version of evaluate_gpus: (objective, completion, changes, allowed)."""
    kg_per_w = problem.slot_emissions_kg_per_w()
    waiting = budget_waiting_slots(problem)
    weighted_s = emissions_kg = leftover_kg = 0.0
    completion: dict[str, float | None] = {}
    changes = misses = 0
    allowed = True
    for job in problem.jobs:
        done, finish, previous, area = 0.0, None, job.current_gpus, 0.0
        for t, g in enumerate(gpus[job.job_id]):
            if g != previous and not (g == 0 and finish is not None):
                changes += 1
            previous = g
            if g in job.allowed_gpus:
                k = job.allowed_gpus.index(g)
                emissions_kg += job.power_w[k] * kg_per_w[t]
                rate = job.throughput_samples_per_s[k]
                if finish is None:
                    if (job.remaining_samples - done) / rate <= problem.slot_s + 1e-9:
                        finish = t * problem.slot_s + (job.remaining_samples - done) / rate
                        done = job.remaining_samples
                    else:
                        done += rate * problem.slot_s
            elif g != 0:
                allowed = False
            area += 1.0 - done / job.remaining_samples
        completion[job.job_id] = finish
        left = 1.0 - done / job.remaining_samples
        max_rate = problem.usable_max_rate(job)
        tail = left * max(job.remaining_samples / (max_rate * problem.slot_s), waiting[job.job_id])
        weighted_s += job.priority * problem.slot_s * (area + tail)
        leftover_kg += left * leftover_kg_per_fraction(problem, job)
        if job.deadline_s is not None:
            ok = finish is not None and finish <= job.deadline_s + 1e-6
            if finish is None and job.deadline_s >= problem.horizon_s:
                after_s = job.deadline_s - problem.horizon_s
                ok = done + max_rate * after_s >= job.remaining_samples * (1 - 1e-9)
            misses += 0 if ok else 1
    objective = (
        problem.deadline_miss_cost_s() * misses
        + weighted_s
        + problem.carbon_price_s_per_kg * (emissions_kg + leftover_kg)
        + problem.change_cost_s * changes
    )
    return objective, completion, changes, allowed


@SETTINGS
@given(problem=problems(max_jobs=4, max_slots=5), data=st.data())
def test_vectorised_evaluation_matches_the_slot_loop(
    problem: AllocationProblem, data: st.DataObject
) -> None:
    # Any matrix, including counts a job may not run at (they must count as off, not allowed).
    gpus = {
        job.job_id: tuple(
            data.draw(st.sampled_from((0, 3, *job.allowed_gpus))) for _ in range(problem.num_slots)
        )
        for job in problem.jobs
    }
    objective, completion, changes, allowed = reference_evaluation(problem, gpus)
    ev = evaluate_gpus(problem, gpus)
    assert ev.objective == pytest.approx(objective, rel=1e-9)
    assert ev.gpu_changes == changes and ev.allowed_ok == allowed
    for job_id, finish in completion.items():
        got = ev.completion_s[job_id]
        assert (got is None) == (finish is None)
        assert got is None or got == pytest.approx(finish, rel=1e-9)
