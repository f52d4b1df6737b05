"""Teams' hard budgets in the plan: a team over its budget gives way, the others plan on.

Each team's hard budget (`AllocationProblem.team_budgets`: its jobs, its kg left per period) binds
only its own jobs. `with_team_budgets` wraps a policy: it plans as if there were no team budgets;
where that plan would spend more than a team has left, the team's jobs are cut back to its budget
(`problem.cut_to_team_budgets`: latest slots first, lowest priority first), and every other job is
planned again on the GPUs and cluster budget those cut jobs leave, so one team's spent budget
stops only its jobs and frees their GPUs for the rest. `make_plan` applies the same cut to any
plan, so no path (admission's solves, stall padding) plans past a team's budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    JobSpec,
    cut_to_team_budgets,
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
        # Half the time for each of the two solves, so a tick keeps its time limit.
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
        # Every job of a team that was cut keeps its cut plan (its budget is what binds it).
        kept = {
            job_id: cut[job_id]
            for team in problem.team_budgets
            if team.job_ids & changed
            for job_id in team.job_ids
            if job_id in cut
        }
        gpus = dict(cut)
        notes = free.notes
        if kept:
            rest = rest_problem(problem, kept)
            if rest.jobs:
                again = policy(rest, previous=None, time_limit_s=time_limit_s / 2, seed=seed)
                gpus.update(again.gpus)
            notes = (
                *notes,
                f"{len(changed)} jobs cut to their team's hard budget; the others planned again"
                " on what they leave",
            )
        return make_plan(
            problem,
            gpus,
            status=free.status,
            policy=free.policy,
            solve_s=time.perf_counter() - began,
            notes=notes,
            step=free.step,
            team_cut={
                job_id: team.team
                for team in problem.team_budgets
                for job_id in team.job_ids & changed
            },
        )

    return team_policy
