"""A lower bound on the best *slot-booked* plan: Lagrangian relaxation of capacity, per-job DP.

Why: the compact LP bound (model.build_compact_lp) lets a job run part of a slot and mix counts,
so it cannot say how much of a plan's gap no integer plan can close. Here each slot's capacity is
priced (lambda_t per GPU-slot, start: the LP's capacity duals) and every job is solved alone and
exactly as an integer plan: whole slots at one allowed count, its deadline met, its completion
area, tail and carbon as in `plan_objective`. sum_j (job j's best cost at the prices) -
sum_t lambda_t * capacity_t is then a lower bound on every plan that keeps capacity, for any
lambda >= 0 (weak duality); a few subgradient steps raise it.
Valid as a bound because: the DP tracks work done on a grid of remaining/`grid` samples and
rounds each slot's work *up* (more work never costs more later), the change cost (>= 0) is left
out, and deadlines no plan can meet are left out on both sides (they cost M in every plan). The
deadlines that can be met are hard constraints here, which is valid only when compared with a
plan that meets them all (then so does the optimum: one miss costs more than all other terms),
so `integer_bound` is only called for such plans. Hard budgets are not modelled (the bench
problems have none). Used by `bench/solver_scale.py --integer-bound` (analysis only: `solve` does not call it).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from scheduler_service.allocation.model import build_compact_lp
from scheduler_service.allocation.problem import AllocationProblem, plan_arrays


def capacity_duals(problem: AllocationProblem) -> np.ndarray:
    """The compact LP's capacity prices (objective seconds per GPU-slot), by scipy's HiGHS."""
    arrays = plan_arrays(problem)
    lp = build_compact_lp(problem, arrays)
    matrix = lp.matrix.tocsr()
    upper = np.flatnonzero(np.isfinite(lp.row_upper))
    lower = np.flatnonzero(np.isfinite(lp.row_lower))
    a_ub = sp.vstack([matrix[upper], -matrix[lower]]).tocsr()
    b_ub = np.concatenate([lp.row_upper[upper], -lp.row_lower[lower]])
    res = linprog(
        lp.cost, A_ub=a_ub, b_ub=b_ub, bounds=np.c_[lp.lower, lp.upper], method="highs-ds"
    )
    if res.status != 0:
        raise RuntimeError(f"LP for the duals ended with status {res.status}: {res.message}")
    # Capacity rows come right after the one-option-per-job-and-slot rows (build_compact_lp).
    first = arrays.num_jobs * problem.num_slots
    marginal = np.zeros(matrix.shape[0])
    marginal[upper] = res.ineqlin.marginals[: len(upper)]
    return np.maximum(-marginal[first : first + problem.num_slots] * problem.slot_s, 0.0)


def _best_rows(
    problem: AllocationProblem, lam: np.ndarray, grid: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per job: (least cost at GPU prices `lam`, GPUs per slot of a row reaching it)."""
    arrays = plan_arrays(problem)
    num_jobs, num_slots, slot_s = arrays.num_jobs, problem.num_slots, problem.slot_s
    unit = arrays.remaining / grid
    # Work per slot in grid units, rounded up (optimistic: keeps the bound valid).
    shift = np.where(
        arrays.valid,
        np.minimum(np.ceil(arrays.throughput * slot_s / unit[:, None] - 1e-9), grid),
        0,
    ).astype(np.int64)
    deadline = np.array([np.inf if j.deadline_s is None else j.deadline_s for j in problem.jobs])
    binding = np.array(
        [
            j.deadline_s is not None and j.deadline_s > 0 and not problem.deadline_impossible(j)
            for j in problem.jobs
        ]
    )
    kg_per_w = problem.slot_emissions_kg_per_w()
    weight_s = arrays.priority * slot_s
    cells = np.arange(grid + 1)[None, :]
    jobs = np.arange(num_jobs)
    area = weight_s[:, None] * (1.0 - cells / grid)  # a slot ending with this much done
    cost = np.full((num_jobs, grid + 1), np.inf)
    cost[:, 0] = 0.0
    choice = np.full((num_slots, num_jobs, grid + 1), -1, dtype=np.int8)
    done_from = np.zeros((num_slots, num_jobs), dtype=np.int64)  # predecessor of "done"
    for t in range(num_slots):
        best = cost.copy()  # off
        pick = np.full((num_jobs, grid + 1), -1, dtype=np.int8)
        # Suffix minima (and where) for reaching "done" from any state at or above a start.
        suffix = np.minimum.accumulate(cost[:, ::-1], axis=1)[:, ::-1]
        # The first state at or above each start holding its suffix minimum: the next state
        # that is a minimum of its own suffix (every state between costs more than it).
        record = np.where(cost <= suffix, cells, grid)
        where = np.minimum.accumulate(record[:, ::-1], axis=1)[:, ::-1]
        from_done = np.full(num_jobs, grid, dtype=np.int64)
        start_s = t * slot_s
        inside = binding & (deadline > start_s) & (deadline < start_s + slot_s)
        frac = np.where(inside, (deadline - start_s) / slot_s, 0.0)
        for k in range(arrays.num_options):
            ok = arrays.valid[:, k] & (arrays.gpus[:, k] <= problem.capacity_gpus[t])
            if not ok.any():
                continue
            s = shift[:, k]
            price = lam[t] * arrays.gpus[:, k] + (
                problem.carbon_price_s_per_kg * arrays.power_w[:, k] * kg_per_w[t]
            )
            before = cells - s[:, None]
            cand = np.where(
                before >= 0, np.take_along_axis(cost, np.maximum(before, 0), axis=1), np.inf
            )
            start = np.maximum(grid - s, 0)
            if inside.any():
                # A deadline inside this slot: only states that finish before it count.
                by_deadline = np.ceil(arrays.throughput[:, k] * frac * slot_s / unit - 1e-9)
                need = np.clip(grid - by_deadline, 0, grid).astype(np.int64)
                cand[inside, :grid] = np.inf
                start = np.where(inside, np.maximum(start, need), start)
            cand[:, grid] = np.take_along_axis(suffix, start[:, None], axis=1)[:, 0]
            cand = np.where(ok[:, None], cand + price[:, None], np.inf)
            better = cand < best
            best = np.where(better, cand, best)
            pick = np.where(better, k, pick)
            from_done = np.where(better[:, grid], where[jobs, start], from_done)
        best[inside, :grid] = np.inf  # past its deadline a job must be done
        ends = binding & (np.abs(deadline - (start_s + slot_s)) < 1e-6)
        best[ends, :grid] = np.inf
        cost = best + area
        choice[t] = pick
        done_from[t] = np.where(pick[:, grid] >= 0, from_done, grid)
    # After the horizon: tail and leftover carbon; deadlines past the horizon.
    left = 1.0 - cells / grid
    cost = cost + left * (
        weight_s[:, None] * arrays.tail_slots[:, None]
        + problem.carbon_price_s_per_kg * arrays.tail_kg[:, None]
    )
    late = binding & (deadline >= problem.horizon_s)
    after = np.where(late, deadline - problem.horizon_s, 0.0)
    extra = np.ceil(arrays.max_throughput * after / unit - 1e-9)
    cost = np.where(late[:, None] & (cells + extra[:, None] < grid), np.inf, cost)
    state = cost.argmin(axis=1)
    values = cost[jobs, state]
    used = np.zeros((num_jobs, num_slots))
    for t in range(num_slots - 1, -1, -1):
        k = choice[t, jobs, state].astype(np.int64)
        on = k >= 0
        used[:, t] = np.where(on, arrays.gpus[jobs, np.maximum(k, 0)], 0)
        s = np.where(on, shift[jobs, np.maximum(k, 0)], 0)
        state = np.where(state == grid, done_from[t], np.maximum(state - s, 0))
    return values, used


def integer_bound(
    problem: AllocationProblem,
    lam: np.ndarray,
    upper_s: float,
    *,
    grid: int = 500,
    steps: int = 15,
    step_scale: float = 0.02,
) -> tuple[float, np.ndarray]:
    """(best Lagrangian bound found, its prices) on the objective without miss terms.

    `upper_s`: a plan's objective without miss terms (it scales the subgradient steps).
    """
    capacity = np.asarray(problem.capacity_gpus, dtype=float)
    best, best_lam = -np.inf, lam.copy()
    for _ in range(steps):
        values, used = _best_rows(problem, lam, grid)
        bound = float(values.sum() - lam @ capacity)
        if bound > best:
            best, best_lam = bound, lam.copy()
        over = used.sum(axis=0) - capacity
        over = np.where((lam <= 0) & (over < 0), 0.0, over)
        norm = float(over @ over)
        if norm == 0:
            break  # the per-job rows fit capacity: this bound is the optimum at these prices
        lam = np.maximum(0.0, lam + step_scale * (upper_s - bound) / norm * over)
    return best, best_lam
