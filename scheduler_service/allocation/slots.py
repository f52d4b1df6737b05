"""Per-slot greedy state and the slot repair/fill step shared by the solver and the baselines."""

from __future__ import annotations

import heapq
import math

import numpy as np

from scheduler_service.allocation.problem import AllocationProblem, BudgetMode, PlanArrays


class SlotState:
    """Per-slot greedy state shared by the rounding heuristic and the baselines."""

    def __init__(self, problem: AllocationProblem, arrays: PlanArrays) -> None:
        self.problem = problem
        self.arrays = arrays
        self.kg_per_w = problem.slot_emissions_kg_per_w()
        self.periods = problem.period_slots() if problem.budget_mode is BudgetMode.HARD else []
        self.period_left_kg = np.array([p.budget_left_kg for p, _ in self.periods], dtype=float)

    def slot_budget_kg(self, t: int, reserve_kg: np.ndarray | None = None) -> float:
        """Emissions slot t may still use without breaking any period's budget."""
        limit = np.inf
        for n, (_, share) in enumerate(self.periods):
            if share[t] <= 0:
                continue
            left = self.period_left_kg[n] - (0.0 if reserve_kg is None else reserve_kg[n])
            limit = min(limit, max(left, 0.0) / share[t])
        return float(limit)

    def charge(self, t: int, kg: float) -> None:
        """Book kg of slot t against every period that holds it."""
        for n, (_, share) in enumerate(self.periods):
            self.period_left_kg[n] -= kg * share[t]


def fit_slot(
    state: SlotState,
    t: int,
    choice: np.ndarray,
    active: np.ndarray,
    loss_weight: np.ndarray,
    gain_weight: np.ndarray,
    budget_kg: float,
    fill: bool,
    min_rate: np.ndarray | None = None,
) -> np.ndarray:
    """Repair one slot's option choice (-1 = off) to capacity and budget, then fill spare GPUs.

    Downgrades take the smallest `loss_weight * lost throughput` per GPU (or kg) freed; filling
    takes the largest `gain_weight * gained throughput` per GPU added while budget allows.
    """
    arrays = state.arrays
    problem = state.problem
    kg_per_w = state.kg_per_w[t]
    cap = problem.capacity_gpus[t]
    n_opts = np.array(arrays.valid.sum(axis=1))
    thr = np.concatenate([np.zeros((arrays.num_jobs, 1)), arrays.throughput], axis=1)
    gpu = np.concatenate([np.zeros((arrays.num_jobs, 1)), arrays.gpus], axis=1)
    pw = np.concatenate([np.zeros((arrays.num_jobs, 1)), arrays.power_w], axis=1)
    idx = choice + 1  # 0 = off

    thr_l, gpu_l, pw_l = thr.tolist(), gpu.tolist(), pw.tolist()
    loss_l = np.asarray(loss_weight, dtype=float).tolist()
    rate_l = None if min_rate is None else np.asarray(min_rate, dtype=float).tolist()
    cur = idx.tolist()

    def down_score(i: int, table: list[list[float]]) -> float:
        k = cur[i]
        lost = (thr_l[i][k] - thr_l[i][k - 1]) * loss_l[i]
        if rate_l is not None and thr_l[i][k - 1] < rate_l[i] * (1 - 1e-9):
            # Falling below the pace a deadline needs costs far more than any other loss.
            lost *= 1e6
        freed = table[i][k] - table[i][k - 1]
        return lost / freed if freed > 0 else math.inf

    def downgrade(excess: float, table: list[list[float]]) -> None:
        # One-at-a-time greedy (cheapest step first), merged over jobs with a heap.
        heap = [(down_score(i, table), i) for i in range(len(cur)) if cur[i] > 0]
        heapq.heapify(heap)
        while excess > 1e-9 and heap:
            score, i = heapq.heappop(heap)
            k = cur[i]
            target = 0 if math.isinf(score) else k - 1  # no saving per step: switch it off
            excess -= table[i][k] - table[i][target]
            cur[i] = target
            if target > 0:
                heapq.heappush(heap, (down_score(i, table), i))

    used = sum(gpu_l[i][cur[i]] for i in range(len(cur)))
    if used > cap:
        downgrade(used - cap, gpu_l)
    if kg_per_w > 0:
        watts = sum(pw_l[i][cur[i]] for i in range(len(cur)))
        limit_w = budget_kg * (1 - 1e-9) / kg_per_w
        if watts > limit_w:
            downgrade(watts - limit_w, pw_l)
    if fill:
        spare = cap - sum(gpu_l[i][cur[i]] for i in range(len(cur)))
        room_kg = budget_kg - sum(pw_l[i][cur[i]] for i in range(len(cur))) * kg_per_w
        gain_l = np.asarray(gain_weight, dtype=float).tolist()
        opts_l = n_opts.tolist()
        active_l = np.asarray(active, dtype=bool).tolist()

        def up_entry(i: int) -> tuple[float, int] | None:
            k = cur[i]
            if not active_l[i] or k >= opts_l[i]:
                return None
            gain = (thr_l[i][k + 1] - thr_l[i][k]) * gain_l[i]
            extra = gpu_l[i][k + 1] - gpu_l[i][k]
            if gain <= 0 or extra <= 0:
                return None
            return (-gain / extra, i)

        heap = [e for e in (up_entry(i) for i in range(len(cur))) if e is not None]
        heapq.heapify(heap)
        while heap and spare > 0:
            _, i = heapq.heappop(heap)
            k = cur[i]
            extra = gpu_l[i][k + 1] - gpu_l[i][k]
            extra_kg = (pw_l[i][k + 1] - pw_l[i][k]) * kg_per_w
            if extra > spare or extra_kg > room_kg + 1e-12:
                continue  # spare and room only shrink: this job cannot grow further
            cur[i] = k + 1
            spare -= extra
            room_kg -= extra_kg
            entry = up_entry(i)
            if entry is not None:
                heapq.heappush(heap, entry)
    idx = np.array(cur, dtype=int)
    return idx - 1
