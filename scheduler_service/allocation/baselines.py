"""Baseline policies with the solver's interface, for comparison (all pure functions).

- carbon-agnostic: ElasticFlow-style; each deadline job gets the smallest count that still meets
  its deadline at a constant pace (earliest deadline first), spare GPUs go to the best marginal
  throughput per GPU (relative to remaining work).
- static: first come first served, each job runs at its largest allowed count from start to end.
- carbon-greedy: CarbonScaler-style; per job, GPU increments are bought slot by slot in order of
  marginal work per gram until the job's work is covered (by its deadline when it has one).
- shift: temporal shifting only; a job runs at one fixed count, started in the cleanest window
  that still meets its deadline.
In hard budget mode every baseline is capped to the budget: a slot whose emissions would exceed
what is left of its period drops the least useful GPUs until it fits.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    PlanArrays,
    gpus_from_options,
    make_plan,
    plan_arrays,
    trim_after_finish,
)
from scheduler_service.allocation.slots import SlotState, fit_slot


def _finish(
    problem: AllocationProblem, plan: np.ndarray, policy: str, started: float
) -> AllocationPlan:
    gpus = trim_after_finish(problem, gpus_from_options(problem, plan_arrays(problem), plan))
    return make_plan(
        problem, gpus, status="baseline", policy=policy, solve_s=time.perf_counter() - started
    )


def _deadlines(problem: AllocationProblem) -> np.ndarray:
    return np.array([np.inf if j.deadline_s is None else j.deadline_s for j in problem.jobs])


def _step(
    state: SlotState, arrays: PlanArrays, t: int, choice: np.ndarray, done: np.ndarray
) -> np.ndarray:
    """Book slot t's choice: charge its emissions and return the new work done per job."""
    rows = np.arange(arrays.num_jobs)
    on = choice >= 0
    k = np.maximum(choice, 0)
    rate = np.where(on, arrays.throughput[rows, k], 0.0)
    power = np.where(on, arrays.power_w[rows, k], 0.0)
    state.charge(t, float(power.sum() * state.kg_per_w[t]))
    return np.minimum(done + rate * state.problem.slot_s, arrays.remaining)


def _edf_min_share(problem: AllocationProblem, *, fill: bool) -> np.ndarray:
    """EDF: each deadline job at the smallest count keeping a constant pace to its deadline.

    With `fill`, spare GPUs go to the best marginal throughput (ElasticFlow); without, jobs
    without a deadline run at their most energy-efficient count (fewest joules per sample).
    """
    arrays = plan_arrays(problem)
    state = SlotState(problem, arrays)
    n, num_slots = arrays.num_jobs, problem.num_slots
    deadline = _deadlines(problem)
    done = np.zeros(n)
    plan = np.full((n, num_slots), -1, dtype=int)
    joules_per_sample = np.where(
        arrays.valid, arrays.power_w / np.maximum(arrays.throughput, 1e-12), np.inf
    )
    leanest = joules_per_sample.argmin(axis=1)
    for t in range(num_slots):
        active = done < arrays.remaining * (1 - 1e-9)
        left_s = deadline - t * problem.slot_s
        has_dl = active & np.isfinite(deadline) & (left_s > 0)
        pace = np.where(has_dl, (arrays.remaining - done) / np.maximum(left_s, 1e-9), 0.0)
        meets = arrays.valid & (arrays.throughput >= pace[:, None] * (1 - 1e-9))
        min_share = np.where(meets.any(axis=1), meets.argmax(axis=1), arrays.valid.sum(axis=1) - 1)
        choice = np.where(has_dl, min_share, -1 if fill else np.where(active, leanest, -1))
        # Earlier deadlines lose GPUs last; ElasticFlow's admission keeps this rare.
        urgency = np.where(has_dl, 1e6 / np.maximum(left_s, 1.0), 0.0)
        loss = arrays.priority / arrays.remaining + urgency
        gain = arrays.priority / arrays.remaining
        choice = fit_slot(state, t, choice, active, loss, gain, state.slot_budget_kg(t), fill=fill)
        plan[:, t] = choice
        done = _step(state, arrays, t, choice, done)
    return plan


def carbon_agnostic(
    problem: AllocationProblem,
    *,
    previous: AllocationPlan | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
) -> AllocationPlan:
    """ElasticFlow-style elastic scheduling: minimum deadline share, then best marginal gain."""
    started = time.perf_counter()
    return _finish(problem, _edf_min_share(problem, fill=True), "carbon-agnostic", started)


def lean_edf(
    problem: AllocationProblem,
    *,
    previous: AllocationPlan | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
) -> AllocationPlan:
    """EDF at the minimum deadline share without filling spare GPUs (least energy per deadline)."""
    started = time.perf_counter()
    return _finish(problem, _edf_min_share(problem, fill=False), "lean-edf", started)


def static_fcfs(
    problem: AllocationProblem,
    *,
    previous: AllocationPlan | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
) -> AllocationPlan:
    """Static allocation: first come first served, each job at its largest allowed count."""
    started = time.perf_counter()
    arrays = plan_arrays(problem)
    state = SlotState(problem, arrays)
    n, num_slots = arrays.num_jobs, problem.num_slots
    done = np.zeros(n)
    plan = np.full((n, num_slots), -1, dtype=int)
    running = np.array([j.current_gpus > 0 for j in problem.jobs])
    top = arrays.valid.sum(axis=1) - 1
    rows = np.arange(n)
    for t in range(num_slots):
        active = done < arrays.remaining * (1 - 1e-9)
        running &= active
        choice = np.where(running, top, -1)
        used = int(arrays.gpus[rows, top][running].sum())
        for i in range(n):  # queue order is arrival order; the head blocks the rest
            if not active[i] or running[i]:
                continue
            if used + arrays.gpus[i, top[i]] > problem.capacity_gpus[t]:
                break
            running[i] = True
            choice[i] = top[i]
            used += int(arrays.gpus[i, top[i]])
        # Budget cap only: a static policy never fills or resizes.
        kept = fit_slot(
            state,
            t,
            choice,
            active,
            arrays.priority / arrays.remaining,
            np.zeros(n),
            state.slot_budget_kg(t),
            fill=False,
        )
        # A job the budget pauses keeps its place but does not run this slot.
        choice = np.where(kept == choice, choice, -1)
        plan[:, t] = choice
        done = _step(state, arrays, t, choice, done)
    return _finish(problem, plan, "static", started)


def carbon_greedy(
    problem: AllocationProblem,
    *,
    previous: AllocationPlan | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
) -> AllocationPlan:
    """CarbonScaler-style: buy GPU increments in order of marginal work per gram, per job."""
    started = time.perf_counter()
    arrays = plan_arrays(problem)
    n, num_slots = arrays.num_jobs, problem.num_slots
    kg_per_w = problem.slot_emissions_kg_per_w()
    deadline = _deadlines(problem)
    cap_left = np.asarray(problem.capacity_gpus, dtype=np.int64).copy()
    plan = np.full((n, num_slots), -1, dtype=int)
    order = sorted(range(n), key=lambda i: (deadline[i], i))
    for i in order:
        n_opt = int(arrays.valid[i].sum())
        last = num_slots
        if np.isfinite(deadline[i]) and deadline[i] > 0:
            last = min(num_slots, int(np.ceil(deadline[i] / problem.slot_s)))
        work = 0.0
        heap: list[tuple[float, int]] = []

        def push(
            t: int, i: int = i, n_opt: int = n_opt, heap: list[tuple[float, int]] = heap
        ) -> None:
            k = plan[i, t]
            if k + 1 >= n_opt:
                return
            d_thr = arrays.throughput[i, k + 1] - (arrays.throughput[i, k] if k >= 0 else 0.0)
            d_kg = (
                arrays.power_w[i, k + 1] - (arrays.power_w[i, k] if k >= 0 else 0.0)
            ) * kg_per_w[t]
            if d_thr <= 0:
                return
            heapq.heappush(heap, (-(d_thr / max(d_kg, 1e-12)), t))

        for t in range(last):
            push(t)
        while heap and work < arrays.remaining[i]:
            _, t = heapq.heappop(heap)
            k = plan[i, t]
            extra = arrays.gpus[i, k + 1] - (arrays.gpus[i, k] if k >= 0 else 0)
            if extra > cap_left[t]:
                continue
            cap_left[t] -= extra
            work += (
                arrays.throughput[i, k + 1] - (arrays.throughput[i, k] if k >= 0 else 0.0)
            ) * problem.slot_s
            plan[i, t] = k + 1
            push(t)
    plan = _cap_to_budget(problem, arrays, plan)
    return _finish(problem, plan, "carbon-greedy", started)


def temporal_shift(
    problem: AllocationProblem,
    *,
    previous: AllocationPlan | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
) -> AllocationPlan:
    """Temporal shifting only: one fixed count, started in the cleanest window meeting the deadline."""
    started = time.perf_counter()
    arrays = plan_arrays(problem)
    n, num_slots = arrays.num_jobs, problem.num_slots
    intensity = np.asarray(problem.intensity_g_per_kwh, dtype=float)
    deadline = _deadlines(problem)
    cap_left = np.asarray(problem.capacity_gpus, dtype=np.int64).copy()
    plan = np.full((n, num_slots), -1, dtype=int)
    running_first = sorted(
        range(n), key=lambda i: (problem.jobs[i].current_gpus == 0, deadline[i], i)
    )
    for i in running_first:
        job = problem.jobs[i]
        k = job.index_of(job.current_gpus) if job.current_gpus else job.index_of(job.fixed_gpus)
        g = int(arrays.gpus[i, k])
        dur = int(np.ceil(arrays.remaining[i] / (arrays.throughput[i, k] * problem.slot_s) - 1e-9))
        if job.current_gpus:
            starts = [0]  # no preemption: a running job keeps running
        else:
            latest = num_slots - min(dur, num_slots)
            if np.isfinite(deadline[i]):
                by_deadline = int(np.floor(deadline[i] / problem.slot_s + 1e-9)) - dur
                latest = min(latest, by_deadline) if by_deadline >= 0 else 0
            starts = list(range(0, max(latest, 0) + 1))

        def window_cost(s: int, dur: int = dur) -> float:
            span = intensity[s : s + dur]
            return float(span.mean()) if len(span) else 0.0

        placed = False
        for s in sorted(starts, key=lambda s: (window_cost(s), s)):
            span = slice(s, min(s + dur, num_slots))
            if np.all(cap_left[span] >= g):
                cap_left[span] -= g
                plan[i, span] = k
                placed = True
                break
        if not placed and job.current_gpus:
            # Capacity shrank under a running job: run it where it still fits.
            fits = cap_left >= g
            plan[i, fits] = k
            cap_left[fits] -= g
    plan = _cap_to_budget(problem, arrays, plan)
    return _finish(problem, plan, "shift", started)


def _cap_to_budget(problem: AllocationProblem, arrays: PlanArrays, plan: np.ndarray) -> np.ndarray:
    """Drop the least useful GPUs from slots that would overspend a hard budget."""
    state = SlotState(problem, arrays)
    if not state.periods:
        return plan
    n = arrays.num_jobs
    done = np.zeros(n)
    out = plan.copy()
    for t in range(problem.num_slots):
        active = done < arrays.remaining * (1 - 1e-9)
        choice = np.where(active, out[:, t], -1)
        choice = fit_slot(
            state,
            t,
            choice,
            active,
            arrays.priority / arrays.remaining,
            np.zeros(n),
            state.slot_budget_kg(t),
            fill=False,
        )
        out[:, t] = choice
        done = _step(state, arrays, t, choice, done)
    return out
