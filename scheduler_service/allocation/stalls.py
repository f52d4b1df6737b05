"""Switch stalls in a plan: a deadline met only without them gets the time they take (issue 23).

Plans count the progress a hot switch stalls (`AllocationProblem.switch_stall_s`), but the
policies build their plans from models without it (a slot's work is its rate times the slot), so
a plan that finishes a deadline job just in time after a few count changes misses it once the
stalls are counted. `pad_for_stalls` gives each such job, latest deadline last, the slots after
its planned finish at its last count on spare GPUs until its stalled work is done, or where
there is no room after it, higher counts before its deadline's slot; `with_stalls`
wraps a policy so every plan it returns has had that done. With no stall modelled both are the
identity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    evaluate_gpus,
    make_plan,
)


def pad_for_stalls(
    problem: AllocationProblem, gpus: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]] | None:
    """The plan with stall-lost work made up on spare GPUs; None: nothing to do.

    A deadline the plan meets without stalls is first padded after its planned finish: the job
    keeps its last count in the slots after it, without a gap (a gap would be a resume, one more
    stall), on GPUs no other job holds, and never past its deadline's slot. Where that finds no
    room, or the plan misses the deadline without stalls too, `_boost` raises the job's counts
    on spare GPUs before its deadline's slot instead.
    """
    if problem.switch_stall_s <= 0:
        return None
    ev = evaluate_gpus(problem, gpus)
    missed = {k for k, ok in ev.deadline_met.items() if not ok}
    if not missed:
        return None
    unstalled = evaluate_gpus(replace(problem, switch_stall_s=0.0), gpus)
    # A deadline missed without stalls too may still be met with more GPUs (`_boost`).
    padable = sorted(
        (j for j in problem.jobs if j.job_id in missed and j.deadline_s is not None),
        key=lambda j: (j.deadline_s, j.job_id),
    )
    if not padable:
        return None
    num_slots = problem.num_slots
    used = np.zeros(num_slots, dtype=np.int64)
    for counts in gpus.values():
        used += np.asarray(counts, dtype=np.int64)
    spare = np.asarray(problem.capacity_gpus, dtype=np.int64) - used
    out = dict(gpus)
    changed = False
    for job in padable:
        assert job.deadline_s is not None
        row = list(gpus[job.job_id])
        running = [t for t, g in enumerate(row) if g > 0]
        if not running:
            continue
        last = running[-1]
        count = row[last]
        until = min(num_slots, math.ceil(job.deadline_s / problem.slot_s - 1e-9))
        # Extended at its last count only where the stalls alone made it late.
        reach = until if unstalled.deadline_met[job.job_id] else last + 1
        alone = replace(problem, jobs=(job,))
        taken: list[int] = []
        met = False
        for t in range(last + 1, reach):
            if spare[t] < count:
                break
            row[t] = count
            spare[t] -= count
            taken.append(t)
            if evaluate_gpus(alone, {job.job_id: tuple(row)}).deadline_met[job.job_id]:
                met = True
                break
        if met:
            out[job.job_id] = tuple(row)
            changed = True
            continue
        for t in taken:
            spare[t] += count
        # No room (or no slot) after the finish: raise the counts it runs at instead, on spare
        # GPUs up to its deadline's slot (greenflow on the 100-job ITP bench, CAISO, price 0:
        # 61 met instead of 57; docs/allocation.md).
        boosted = _boost(alone, job.job_id, tuple(gpus[job.job_id]), spare, until)
        if boosted is not None:
            for t, g in enumerate(boosted):
                spare[t] -= g - gpus[job.job_id][t]
            out[job.job_id] = boosted
            changed = True
    if not changed:
        return None
    padded = evaluate_gpus(problem, out)
    if not (padded.capacity_ok and padded.budget_ok) or padded.objective >= ev.objective:
        return None
    return out


def _boost(
    alone: AllocationProblem,
    job_id: str,
    row: tuple[int, ...],
    spare: np.ndarray,
    until: int,
) -> tuple[int, ...] | None:
    """`row` with higher counts on `spare` GPUs before slot `until` so the job alone meets its
    deadline with its stalls, or None: first one count level flattened (every running slot at
    the highest count it runs at, no change left between them), then one slot raised."""
    job = alone.jobs[0]
    running = [t for t, g in enumerate(row) if g > 0 and t < until]
    if not running:
        return None

    def met(candidate: list[int]) -> tuple[int, ...] | None:
        """`candidate` up to the slot the job finishes in (GPUs after it handed back), or None
        when it misses the deadline."""
        ev = evaluate_gpus(alone, {job_id: tuple(candidate)})
        finish_s = ev.completion_s.get(job_id)
        if not ev.deadline_met[job_id] or finish_s is None:
            return None
        last = max(0, math.ceil(finish_s / alone.slot_s - 1e-9) - 1)
        return tuple(g if t <= last else 0 for t, g in enumerate(candidate))

    top = max(row[t] for t in running)
    if all(spare[t] >= top - row[t] for t in running):
        flat = list(row)
        for t in running:
            flat[t] = top
        if (kept := met(flat)) is not None:
            return kept
    # The slot it finishes in first: the stall it starts with is the one that pushed it late.
    for t in reversed(running):
        for g in job.allowed_gpus:
            if g <= row[t]:
                continue
            if spare[t] < g - row[t]:
                break
            candidate = list(row)
            candidate[t] = g
            if (kept := met(candidate)) is not None:
                return kept
    return None


def padded_plan(problem: AllocationProblem, plan: AllocationPlan) -> AllocationPlan:
    """`plan`, padded for switch stalls where that helps (`pad_for_stalls`)."""
    began = time.perf_counter()
    gpus = pad_for_stalls(problem, plan.gpus)
    if gpus is None:
        return plan
    return make_plan(
        problem,
        gpus,
        status=plan.status,
        policy=plan.policy,
        solve_s=plan.solve_s + time.perf_counter() - began,
        bound=plan.bound,
        notes=(*plan.notes, "padded for switch stalls"),
        gpu_price_per_slot=plan.gpu_price_per_slot,
        step=plan.step,
        team_cut=plan.team_cut,
    )


def with_stalls(policy: Callable[..., AllocationPlan]) -> Callable[..., AllocationPlan]:
    """`policy`, its plans padded for switch stalls (`pad_for_stalls`) where that helps."""

    def padded_policy(
        problem: AllocationProblem,
        *,
        previous: AllocationPlan | None = None,
        time_limit_s: float = 2.0,
        seed: int = 0,
    ) -> AllocationPlan:
        plan = policy(problem, previous=previous, time_limit_s=time_limit_s, seed=seed)
        return padded_plan(problem, plan)

    padded_policy.__name__ = getattr(policy, "__name__", "policy")
    padded_policy.__doc__ = policy.__doc__
    return padded_policy
