"""Teams' hard budgets in the plan: a team over its budget gives way, the others plan on.

Each team's hard budget (`AllocationProblem.team_budgets`: its jobs, its kg left per period) binds
only its own jobs. `with_team_budgets` wraps a policy: it plans as if there were no team budgets;
where that plan would spend more than a team has left, the team's jobs are planned again among
themselves (`team_problem`: only its jobs, its budget as the hard cap, on the GPUs the other
jobs left free plus its own), and the better of that plan and the plain cut
(`problem.cut_to_team_budgets`: latest slots first, lowest priority first) by the team's
objective is kept; then every other job is planned again on the GPUs and cluster budget the
team's jobs leave, so one team's spent budget stops only its jobs and frees their GPUs for the
rest. `make_plan` applies the cut to any plan, so no path (admission's solves, stall padding)
plans past a team's budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    BudgetMode,
    JobSpec,
    TeamBudget,
    cut_to_team_budgets,
    evaluate_gpus,
    make_plan,
)


def _power_w(job: JobSpec, count: int) -> float:
    return 0.0 if count == 0 else job.power_w[job.allowed_gpus.index(count)]


def rest_problem(problem: AllocationProblem, kept: dict[str, tuple[int, ...]]) -> AllocationProblem:
    """The problem of every job but `kept`'s, on the GPUs and cluster budget `kept` leaves."""
    jobs = {job.job_id: job for job in problem.jobs}
    used = np.zeros(problem.num_slots, dtype=np.int64)
    power = np.zeros(problem.num_slots)
    for job_id, counts in kept.items():
        used += np.asarray(counts, dtype=np.int64)
        power += np.array([_power_w(jobs[job_id], g) for g in counts])
    kept_kg = power * problem.slot_emissions_kg_per_w()
    periods = []
    for period in problem.budget_periods:
        shares = problem.period_slots((period,))
        spent = float((kept_kg * shares[0][1]).sum()) if shares else 0.0
        periods.append(replace(period, budget_left_kg=max(0.0, period.budget_left_kg - spent)))
    return replace(
        problem,
        jobs=tuple(job for job in problem.jobs if job.job_id not in kept),
        capacity_gpus=tuple(
            int(c) for c in np.maximum(np.asarray(problem.capacity_gpus) - used, 0)
        ),
        budget_periods=tuple(periods),
        team_budgets=tuple(t for t in problem.team_budgets if not t.job_ids & kept.keys()),
    )


def _usage(
    problem: AllocationProblem, gpus: dict[str, tuple[int, ...]], ids: set[str]
) -> np.ndarray:
    """GPUs the jobs `ids` use per slot under `gpus`."""
    used = np.zeros(problem.num_slots, dtype=np.int64)
    for job_id in ids & gpus.keys():
        used += np.asarray(gpus[job_id], dtype=np.int64)
    return used


def team_problem(
    problem: AllocationProblem, team: TeamBudget, capacity: np.ndarray
) -> AllocationProblem:
    """The sub-problem of one team's jobs: its budget per period (no more than the cluster's
    budget left in that period, where the cluster's is hard) as a hard cap, on `capacity` GPUs."""
    periods = []
    for period in team.periods:
        left = period.budget_left_kg
        if problem.budget_mode == BudgetMode.HARD:
            for cluster in problem.budget_periods:
                if cluster.start_s < period.end_s and period.start_s < cluster.end_s:
                    left = min(left, cluster.budget_left_kg)
        periods.append(replace(period, budget_left_kg=left))
    return replace(
        problem,
        jobs=tuple(job for job in problem.jobs if job.job_id in team.job_ids),
        capacity_gpus=tuple(int(c) for c in np.maximum(capacity, 0)),
        budget_periods=tuple(periods),
        budget_mode=BudgetMode.HARD,
        team_budgets=(),
    )


def replan_team(
    policy: Callable[..., AllocationPlan],
    problem: AllocationProblem,
    team: TeamBudget,
    capacity: np.ndarray,
    cut: dict[str, tuple[int, ...]],
    *,
    time_limit_s: float,
    seed: int,
) -> dict[str, tuple[int, ...]]:
    """The team's jobs planned again among themselves under its budget (`team_problem`), or
    their plain cut `cut` where that scores better on the team's objective (never worse)."""
    sub = team_problem(problem, team, capacity)
    ids = {job.job_id for job in sub.jobs}
    mine = {job_id: cut[job_id] for job_id in ids}
    if not sub.jobs:
        return mine
    plan = policy(sub, previous=None, time_limit_s=time_limit_s, seed=seed)
    # The same cut as any plan gets, in case the policy's own budget check was approximate.
    again = cut_to_team_budgets(replace(sub, team_budgets=(team,)), plan.gpus)
    candidate = evaluate_gpus(sub, again)
    if (
        candidate.capacity_ok
        and candidate.budget_ok
        and candidate.objective <= evaluate_gpus(sub, mine).objective
    ):
        return {job_id: again[job_id] for job_id in ids}
    return mine


def with_team_budgets(policy: Callable[..., AllocationPlan]) -> Callable[..., AllocationPlan]:
    """`policy`, its plans held to the teams' hard budgets (module docstring)."""

    def team_policy(
        problem: AllocationProblem,
        *,
        previous: AllocationPlan | None = None,
        time_limit_s: float = 2.0,
        seed: int = 0,
    ) -> AllocationPlan:
        if not problem.team_budgets:
            return policy(problem, previous=previous, time_limit_s=time_limit_s, seed=seed)
        began = time.perf_counter()
        # Half the time for the plan without team budgets (the plan itself when none binds), a
        # quarter for the teams over theirs, a quarter for the rest: a tick keeps its limit.
        free = policy(
            replace(problem, team_budgets=()),
            previous=previous,
            time_limit_s=time_limit_s / 2,
            seed=seed,
        )
        cut = cut_to_team_budgets(problem, free.gpus)
        changed = {
            job_id for job_id, counts in cut.items() if counts != tuple(map(int, free.gpus[job_id]))
        }
        over = [team for team in problem.team_budgets if team.job_ids & changed]
        # Every job of a team over its budget keeps the plan its budget allows.
        kept: dict[str, tuple[int, ...]] = {}
        over_ids = {job_id for team in over for job_id in team.job_ids}
        # Each team may use its own GPUs of the free plan and those nobody used; the others'
        # stay theirs until they are planned again below.
        taken = _usage(problem, free.gpus, set(free.gpus) - over_ids)
        for index, team in enumerate(over):
            later = {job_id for t in over[index + 1 :] for job_id in t.job_ids}
            capacity = (
                np.asarray(problem.capacity_gpus, dtype=np.int64)
                - taken
                - _usage(problem, kept, set(kept))
                - _usage(problem, free.gpus, later)
            )
            kept.update(
                replan_team(
                    policy,
                    problem,
                    team,
                    capacity,
                    cut,
                    time_limit_s=time_limit_s / (4 * len(over)),
                    seed=seed,
                )
            )
        gpus = dict(cut)
        gpus.update(kept)
        notes = free.notes
        if kept:
            rest = rest_problem(problem, kept)
            if rest.jobs:
                again = policy(rest, previous=None, time_limit_s=time_limit_s / 4, seed=seed)
                gpus.update(again.gpus)
            notes = (
                *notes,
                f"{len(changed)} jobs over their team's hard budget, planned again among their"
                " team under it; the others planned again on what they leave",
            )
        return make_plan(
            problem,
            gpus,
            status=free.status,
            policy=free.policy,
            solve_s=time.perf_counter() - began,
            notes=notes,
            step=free.step,
            # Every job of a team over its budget: what it runs is what the team's budget pays.
            team_cut={job_id: team.team for team in over for job_id in team.job_ids & kept.keys()},
        )

    return team_policy
