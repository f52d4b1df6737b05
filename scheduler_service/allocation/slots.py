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
        self._tables: OptionTables | None = None

    @property
    def tables(self) -> OptionTables:
        """The option tables as lists, built once per state: at 5,000 jobs x 288 slots
        rebuilding them for every slot took longer than the rest of the baselines."""
        if self._tables is None:
            self._tables = OptionTables(self.arrays)
        return self._tables

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


class OptionTables:
    """Throughput, GPUs and power per job and option as lists, with a leading "off" entry
    (position 0 = off, k + 1 = option k), and how many options each job has."""

    def __init__(self, arrays: PlanArrays) -> None:
        off = np.zeros((arrays.num_jobs, 1))
        self.thr_a = np.concatenate([off, arrays.throughput], axis=1)
        self.gpu_a = np.concatenate([off, arrays.gpus], axis=1)
        self.pw_a = np.concatenate([off, arrays.power_w], axis=1)
        self.n_opts_a = arrays.valid.sum(axis=1)
        self.thr: list[list[float]] = self.thr_a.tolist()
        self.gpu: list[list[float]] = self.gpu_a.tolist()
        self.pw: list[list[float]] = self.pw_a.tolist()
        self.n_opts: list[int] = self.n_opts_a.tolist()


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
    problem = state.problem
    kg_per_w = state.kg_per_w[t]
    cap = problem.capacity_gpus[t]
    tables = state.tables
    idx = choice + 1  # 0 = off

    thr_l, gpu_l, pw_l = tables.thr, tables.gpu, tables.pw
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

    def down_scores(table_a: np.ndarray) -> list[tuple[float, int]]:
        # `down_score` of every running job at once (the same float operations, in numpy).
        cur_a = np.array(cur, dtype=np.int64)
        rows = np.flatnonzero(cur_a > 0)
        k = cur_a[rows]
        lost = (tables.thr_a[rows, k] - tables.thr_a[rows, k - 1]) * np.asarray(
            loss_weight, dtype=float
        )[rows]
        if min_rate is not None:
            floor = np.asarray(min_rate, dtype=float)[rows] * (1 - 1e-9)
            lost = np.where(tables.thr_a[rows, k - 1] < floor, lost * 1e6, lost)
        freed = table_a[rows, k] - table_a[rows, k - 1]
        score = np.divide(lost, freed, out=np.full(len(rows), math.inf), where=freed > 0)
        return list(zip(score.tolist(), rows.tolist(), strict=True))

    def downgrade(excess: float, table: list[list[float]], table_a: np.ndarray) -> None:
        # One-at-a-time greedy (cheapest step first), merged over jobs with a heap.
        heap = down_scores(table_a)
        heapq.heapify(heap)
        while excess > 1e-9 and heap:
            score, i = heapq.heappop(heap)
            k = cur[i]
            target = 0 if math.isinf(score) else k - 1  # no saving per step: switch it off
            excess -= table[i][k] - table[i][target]
            cur[i] = target
            if target > 0:
                heapq.heappush(heap, (down_score(i, table), i))

    every = np.arange(len(cur))

    def booked(table_a: np.ndarray) -> float:
        # The same sum as over the lists, job by job in order (so the same float), from numpy.
        return float(sum(table_a[every, np.array(cur, dtype=np.int64)].tolist()))

    used = booked(tables.gpu_a)
    if used > cap:
        downgrade(used - cap, gpu_l, tables.gpu_a)
    if kg_per_w > 0:
        watts = booked(tables.pw_a)
        limit_w = budget_kg * (1 - 1e-9) / kg_per_w
        if watts > limit_w:
            downgrade(watts - limit_w, pw_l, tables.pw_a)
    if fill:
        spare = cap - booked(tables.gpu_a)
        room_kg = budget_kg - booked(tables.pw_a) * kg_per_w
        gain_l = np.asarray(gain_weight, dtype=float).tolist()
        opts_l = tables.n_opts
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

        # `up_entry` of every job at once (the same float operations, in numpy).
        cur_a = np.array(cur, dtype=np.int64)
        rows = np.flatnonzero(np.asarray(active, dtype=bool) & (cur_a < tables.n_opts_a))
        k = cur_a[rows]
        gain = (tables.thr_a[rows, k + 1] - tables.thr_a[rows, k]) * np.asarray(
            gain_weight, dtype=float
        )[rows]
        extra = tables.gpu_a[rows, k + 1] - tables.gpu_a[rows, k]
        grows = (gain > 0) & (extra > 0)
        heap = list(zip((-gain[grows] / extra[grows]).tolist(), rows[grows].tolist(), strict=True))
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
