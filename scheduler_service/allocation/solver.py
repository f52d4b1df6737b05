"""GreenFlow's allocation solver: horizon LP (HiGHS) + guided rounding, exact MIP (SCIP) when small.

Why these solvers (measured on the 2-core dev machine, see docs/allocation.md):
- The LP relaxation of the time-indexed model is built from numpy arrays as one CSR matrix and
  handed to OR-Tools' ModelBuilder, so model building stays vectorised and near-linear in
  jobs x slots x counts. HiGHS (through OR-Tools) solves that LP faster than GLOP or PDLP here.
- Rounding the LP slot by slot (tracking the LP's cumulative progress targets and per-slot carbon
  allowances, preferring each job's previous count) gives an integer plan within a small gap of
  the LP bound at scale; this is the path that keeps 1,000+ jobs fast.
- Small problems (few binaries), and the slots up to the nearest deadlines, are solved exactly
  as a MIP with HiGHS (measured 1.4-2x faster than SCIP on our small time-indexed MIPs). CP-SAT is
  not used: the model has continuous progress variables, which CP-SAT cannot represent.
The objective is lexicographic through weights: deadline misses first, then priority-weighted
completion time, then carbon (at the problem's price) and GPU-count changes.
"""

from __future__ import annotations

import heapq
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from ortools.linear_solver.python import model_builder as mb

from scheduler_service.allocation.model import (
    BuiltModel,
    CompactLp,
    build_compact_lp,
    build_model,
)
from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    BudgetMode,
    JobSpec,
    PlanArrays,
    evaluate_gpus,
    make_plan,
)

# Above this many binaries the exact MIP is skipped: LP + rounding is used alone.
EXACT_MAX_BINARIES = 150
# The deadline repair re-evaluates whole plans per move: only worth it on small problems.
REPAIR_MAX_JOBS = 100


class SolverError(RuntimeError):
    """The LP solver failed in a way no plan can be built from (the message says how)."""


@dataclass(frozen=True)
class LpResult:
    """Values of the LP relaxation: bound (same units as plan_objective) and per-slot targets."""

    bound: float
    x: np.ndarray  # [num_options, num_slots]
    cumulative: np.ndarray  # [jobs, slots] fraction of remaining work done by the slot's end
    missed: np.ndarray  # [jobs] the LP's deadline-miss variable (0 without a deadline)


@contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """Send C-level stdout to stderr: HiGHS' MIP prints debug lines even with output_flag off."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no real fd 1 (e.g. captured): nothing to protect
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _all_values(solver: mb.Solver, model: mb.Model) -> np.ndarray:
    """Every variable's value as one array (the public per-variable path costs ~1 s at 300k)."""
    helper = getattr(solver, "_Solver__solve_helper", None)
    if helper is not None and hasattr(helper, "variable_values"):
        return np.asarray(helper.variable_values(), dtype=float)
    return solver.values(model.get_variables()).to_numpy(dtype=float)


def _to_model(built: BuiltModel | CompactLp, *, integer: bool) -> mb.Model:
    model = mb.Model()
    fill: Any = model.helper.fill_model_from_sparse_data  # its stub's ndarray types are too narrow
    fill(built.lower, built.upper, built.cost, built.row_lower, built.row_upper, built.matrix)
    if integer and isinstance(built, BuiltModel):
        for index in np.flatnonzero(built.integer):
            model.helper.set_var_integrality(int(index), True)
    return model


def solve_lp(problem: AllocationProblem, arrays: PlanArrays) -> LpResult:
    """Solve the compact LP relaxation with HiGHS; returns the bound and the fractional plan."""
    built = build_compact_lp(problem, arrays)
    model = _to_model(built, integer=False)
    solver = mb.Solver("highs")
    solver.set_solver_specific_parameters("output_flag=false\nthreads=1\n")
    status = solver.solve(model)
    if status not in (mb.SolveStatus.OPTIMAL, mb.SolveStatus.FEASIBLE):
        raise SolverError(f"LP relaxation ended with status {status.name}")
    values = _all_values(solver, model)
    num_slots = problem.num_slots
    n_x = len(built.opt_job) * num_slots
    x = np.clip(values[:n_x].reshape(-1, num_slots), 0.0, 1.0)
    per_slot = np.zeros((arrays.num_jobs, num_slots))
    np.add.at(per_slot, built.opt_job, x * built.progress[:, None])
    cumulative = np.cumsum(per_slot, axis=1)
    bound = (float(solver.objective_value) + built.offset) * problem.slot_s
    missed = np.zeros(arrays.num_jobs)
    deadline_jobs = [i for i, j in enumerate(problem.jobs) if j.deadline_s is not None]
    missed[deadline_jobs] = values[n_x : n_x + len(deadline_jobs)]
    return LpResult(bound=bound, x=x, cumulative=cumulative, missed=missed)


def solve_mip(
    problem: AllocationProblem,
    arrays: PlanArrays,
    hint: dict[str, tuple[int, ...]] | None,
    time_limit_s: float,
    seed: int,
) -> tuple[dict[str, tuple[int, ...]] | None, float | None, bool]:
    """Exact MIP with HiGHS: (GPU matrix or None, best bound, proven optimal)."""
    built = build_model(problem, arrays, with_changes=True)
    model = _to_model(built, integer=True)
    # No solution hint: OR-Tools 9.15 segfaults passing hints to HiGHS (reproduced here). The
    # warm start lives on as a candidate plan that the MIP's answer must beat (see `solve`).
    del hint
    solver = mb.Solver("highs")
    solver.set_time_limit_in_seconds(max(time_limit_s, 0.05))
    solver.set_solver_specific_parameters(
        f"output_flag=false\nthreads=1\nrandom_seed={int(seed)}\nmip_rel_gap=1e-4\n"
    )
    with _native_stdout_to_stderr():
        status = solver.solve(model)
    if status not in (mb.SolveStatus.OPTIMAL, mb.SolveStatus.FEASIBLE):
        return None, None, False
    values = _all_values(solver, model)
    x = values[built.x_start : built.c_start].reshape(-1, built.num_slots) > 0.5
    gpus = {job.job_id: [0] * built.num_slots for job in problem.jobs}
    for o, (j, k) in enumerate(zip(built.opt_job, built.opt_k, strict=True)):
        job = problem.jobs[j]
        for t in np.flatnonzero(x[o]):
            gpus[job.job_id][int(t)] = job.allowed_gpus[k]
    bound = (float(solver.best_objective_bound) + built.offset) * problem.slot_s
    return (
        {k: tuple(v) for k, v in gpus.items()},
        bound,
        status == mb.SolveStatus.OPTIMAL,
    )


def trim_after_finish(
    problem: AllocationProblem, gpus: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Release GPUs in slots after each job's projected finish (never worse on the objective)."""
    ev = evaluate_gpus(problem, gpus)
    out = {}
    for job in problem.jobs:
        counts = list(gpus[job.job_id])
        finish = ev.completion_s[job.job_id]
        if finish is not None:
            last = int(finish // problem.slot_s)
            if finish > 0 and finish % problem.slot_s == 0:
                last -= 1
            for t in range(last + 1, len(counts)):
                counts[t] = 0
        out[job.job_id] = tuple(counts)
    return out


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


def round_lp(
    problem: AllocationProblem,
    arrays: PlanArrays,
    lp: LpResult | None,
    prefer: dict[str, int] | None = None,
    mode: str = "ceil",
    prefix: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Integer plan that tracks the LP's cumulative targets slot by slot (see module doc).

    mode "ceil" takes the slowest count that keeps the LP's pace, "nearest" the count whose
    throughput is closest to it; neither wins everywhere, so `solve` tries both.
    `prefix` fixes the counts of the first slots.
    """
    prefix_idx = None
    if prefix is not None:
        prefix_idx = np.array([[j.index_of(g) for g in prefix[j.job_id]] for j in problem.jobs])
    num_jobs, num_slots = arrays.num_jobs, problem.num_slots
    state = SlotState(problem, arrays)
    done = np.zeros(num_jobs)  # samples done so far in the plan
    remaining = arrays.remaining
    choice_prev = np.array([j.index_of(j.current_gpus) for j in problem.jobs], dtype=int)
    if prefer:
        choice_prev = np.array(
            [j.index_of(prefer.get(j.job_id, j.current_gpus)) for j in problem.jobs], dtype=int
        )
    plan = np.full((num_jobs, num_slots), -1, dtype=int)
    target = None if lp is None else lp.cumulative * remaining[:, None]
    lp_kg = None
    if lp is not None:
        power = arrays.power_w[state_opt(arrays)]
        lp_kg = (lp.x * power[:, None]) * state.kg_per_w[None, :]
    deadline = np.array(
        [j.deadline_s if j.deadline_s is not None else np.inf for j in problem.jobs]
    )
    savable = deadline < np.inf
    if lp is not None:
        savable &= lp_deadline_met(problem, lp)
    for t in range(num_slots):
        active = done < remaining * (1 - 1e-9)
        if target is not None:
            need = np.clip(target[:, t] - done, 0, None) / problem.slot_s
        else:
            need = np.where(active, np.inf, 0.0)
        # Deadline jobs the LP can serve keep at least the constant pace that still meets them.
        left_s = deadline - t * problem.slot_s
        pace = np.where(
            savable & active & (left_s > 0), (remaining - done) / np.maximum(left_s, 1e-9), 0.0
        )
        need = np.maximum(need, pace)
        # Smallest option whose throughput meets the LP's pace.
        meets = arrays.valid & (arrays.throughput >= need[:, None] * (1 - 1e-6))
        first = np.where(meets.any(axis=1), meets.argmax(axis=1), arrays.valid.sum(axis=1) - 1)
        choice = np.where(active & (need > 1e-12), first, -1)
        if mode == "nearest":
            thr_pad = np.where(arrays.valid, arrays.throughput, np.inf)
            diff = np.abs(
                np.concatenate([np.zeros((num_jobs, 1)), thr_pad], axis=1) - need[:, None]
            )
            choice = np.where(active, diff.argmin(axis=1) - 1, -1)
        # Deadline jobs keep the pace that still meets them in every mode.
        choice = np.where(savable & (pace > 0), np.maximum(choice, first), choice)
        # Keep the previous count when it also meets the pace and is not much faster (no switch).
        keep = (choice_prev >= 0) & active & (need > 1e-12)
        prev_thr = np.where(
            choice_prev >= 0, arrays.throughput[np.arange(num_jobs), np.maximum(choice_prev, 0)], 0
        )
        chosen_thr = np.where(
            choice >= 0, arrays.throughput[np.arange(num_jobs), np.maximum(choice, 0)], 0
        )
        keep &= (prev_thr >= need * 0.95) & (prev_thr <= chosen_thr * 1.5)
        choice = np.where(keep, choice_prev, choice)
        # Deadline jobs are the last to lose GPUs; small remaining work gains most per sample.
        loss_weight = arrays.priority / remaining
        gain_weight = arrays.priority / remaining
        if problem.carbon_price_s_per_kg > 0 or problem.budget_mode is BudgetMode.HARD:
            # Fill dirty slots less eagerly than the LP when it left them idle.
            gain_weight = gain_weight * np.where(need > 1e-12, 1.0, 1e-3)
        reserve = None
        if lp_kg is not None and state.periods:
            reserve = np.array(
                [
                    float((lp_kg[:, t + 1 :].sum(axis=0) * share[t + 1 :]).sum())
                    for _, share in state.periods
                ]
            )
        budget = state.slot_budget_kg(t, reserve)
        if reserve is not None and budget <= 0:
            budget = state.slot_budget_kg(t)
        fill = problem.carbon_price_s_per_kg == 0 or lp is None
        if prefix_idx is not None and t < prefix_idx.shape[1]:
            choice = np.where(active, prefix_idx[:, t], -1)
            fill = False
        choice = fit_slot(
            state, t, choice, active, loss_weight, gain_weight, budget, fill=fill, min_rate=pace
        )
        plan[:, t] = choice
        on = choice >= 0
        rate = np.where(on, arrays.throughput[np.arange(num_jobs), np.maximum(choice, 0)], 0.0)
        power = np.where(on, arrays.power_w[np.arange(num_jobs), np.maximum(choice, 0)], 0.0)
        state.charge(t, float(power.sum() * state.kg_per_w[t]))
        done = np.minimum(done + rate * problem.slot_s, remaining)
        choice_prev = np.where(active, choice, -1)
    out = {}
    for i, job in enumerate(problem.jobs):
        out[job.job_id] = tuple(0 if k < 0 else job.allowed_gpus[k] for k in plan[i])
    return out


def repair_deadlines(
    problem: AllocationProblem,
    gpus: dict[str, tuple[int, ...]],
    savable: set[str],
    deadline_s: float,
) -> dict[str, tuple[int, ...]]:
    """Give GPUs to savable jobs that miss their deadline, taking them from jobs that can spare
    them, as long as no met deadline breaks; stops at `deadline_s` (perf_counter time)."""
    plan = {k: list(v) for k, v in gpus.items()}
    base = evaluate_gpus(problem, gpus)
    met = {k for k, ok in base.deadline_met.items() if ok}
    best_objective = base.objective
    jobs = {j.job_id: j for j in problem.jobs}
    order = sorted(
        (j for j in problem.jobs if j.job_id in savable and j.job_id not in met),
        key=lambda j: j.deadline_s or 0.0,
    )
    for job in order:
        assert job.deadline_s is not None
        last = min(problem.num_slots, int(np.ceil(job.deadline_s / problem.slot_s)))
        for t in range(last):
            if time.perf_counter() > deadline_s:
                return {k: tuple(v) for k, v in plan.items()}
            for g in job.allowed_gpus:
                if g <= plan[job.job_id][t]:
                    continue
                trial = {k: list(v) for k, v in plan.items()}
                trial[job.job_id][t] = g
                free = problem.capacity_gpus[t] - sum(v[t] for v in trial.values())
                # Take GPUs from the jobs least hurt: no deadline first, then latest deadline.
                donors = sorted(
                    (k for k in trial if k != job.job_id and trial[k][t] > 0),
                    key=lambda k: (jobs[k].deadline_s is not None, -(jobs[k].deadline_s or 0.0)),
                )
                for donor in donors:
                    if free >= 0:
                        break
                    free += trial[donor][t]
                    trial[donor][t] = 0
                if free < 0:
                    continue
                frozen = {k: tuple(v) for k, v in trial.items()}
                ev = evaluate_gpus(problem, frozen)
                if not (ev.capacity_ok and ev.budget_ok):
                    continue
                if all(ev.deadline_met[k] for k in met) and ev.objective < best_objective:
                    plan, best_objective = trial, ev.objective
                    if ev.deadline_met[job.job_id]:
                        met.add(job.job_id)
                    break
            if job.job_id in met:
                break
    return {k: tuple(v) for k, v in plan.items()}


def lp_deadline_met(problem: AllocationProblem, lp: LpResult) -> np.ndarray:
    """Per job: the LP relaxation meets its deadline (False for jobs without one)."""
    has = np.array([j.deadline_s is not None for j in problem.jobs], dtype=bool)
    return has & (lp.missed <= 1e-6)


def state_opt(arrays: PlanArrays) -> tuple[np.ndarray, np.ndarray]:
    """(job, option) index arrays of every valid option, in model order."""
    return np.nonzero(arrays.valid)  # type: ignore[return-value]


def shift_previous(
    previous: AllocationPlan | None, problem: AllocationProblem
) -> dict[str, tuple[int, ...]] | None:
    """The previous plan moved to this problem's start (new jobs off, last slot repeated)."""
    if previous is None:
        return None
    offset = round((problem.start_at - previous.start_at).total_seconds() / problem.slot_s)
    if offset < 0 or abs(previous.slot_s - problem.slot_s) > 1e-9:
        return None
    out = {}
    for job in problem.jobs:
        old = previous.gpus.get(job.job_id)
        counts = list(old[offset:]) if old is not None else []
        counts = [g if g in job.allowed_gpus else 0 for g in counts]
        fill = counts[-1] if counts else 0
        counts = (counts + [fill] * problem.num_slots)[: problem.num_slots]
        out[job.job_id] = tuple(counts)
    return out


def solve(
    problem: AllocationProblem,
    *,
    previous: AllocationPlan | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
) -> AllocationPlan:
    """Best plan found within `time_limit_s` (deterministic for a fixed seed)."""
    started = time.perf_counter()
    if not problem.jobs:
        return make_plan(problem, {}, status="optimal", policy="greenflow", solve_s=0.0, bound=0.0)
    arrays = PlanArrays(problem)
    lp = solve_lp(problem, arrays)
    prefer = None
    warm = shift_previous(previous, problem)
    if warm is not None:
        prefer = {job_id: counts[0] for job_id, counts in warm.items()}
    candidates: list[tuple[dict[str, tuple[int, ...]], str]] = []
    for mode in ("ceil", "nearest"):
        candidates.append(
            (trim_after_finish(problem, round_lp(problem, arrays, lp, prefer, mode)), "heuristic")
        )
    candidates.append(
        (trim_after_finish(problem, round_lp(problem, arrays, None, prefer)), "heuristic")
    )
    if warm is not None:
        candidates.append((trim_after_finish(problem, warm), "heuristic"))
    near = _near_deadline_mip(problem, arrays, lp, prefer, started + time_limit_s * 0.5, seed)
    if near is not None:
        candidates.append((near, "heuristic"))
    feasible = [(g, s) for g, s in candidates if _feasible(problem, g)]
    best = min(feasible, key=lambda c: evaluate_gpus(problem, c[0]).objective) if feasible else None
    savable = {
        j.job_id for j, ok in zip(problem.jobs, lp_deadline_met(problem, lp), strict=True) if ok
    }
    if (
        best is not None
        and len(problem.jobs) <= REPAIR_MAX_JOBS
        and any(
            not best_ev_ok
            for k, best_ev_ok in evaluate_gpus(problem, best[0]).deadline_met.items()
            if k in savable
        )
    ):
        repaired = trim_after_finish(
            problem,
            repair_deadlines(problem, best[0], savable, started + time_limit_s * 0.5),
        )
        if (
            _feasible(problem, repaired)
            and evaluate_gpus(problem, repaired).objective
            < evaluate_gpus(problem, best[0]).objective
        ):
            best = (repaired, "heuristic")
    bound = lp.bound
    status = "heuristic"
    binaries = int(arrays.valid.sum()) * problem.num_slots * 2
    left_s = time_limit_s - (time.perf_counter() - started)
    if binaries <= EXACT_MAX_BINARIES and left_s > 0:
        gpus, mip_bound, optimal = solve_mip(
            problem, arrays, best[0] if best else None, left_s, seed
        )
        if gpus is not None:
            gpus = trim_after_finish(problem, gpus)
            if _feasible(problem, gpus) and (
                best is None
                or evaluate_gpus(problem, gpus).objective
                <= evaluate_gpus(problem, best[0]).objective
            ):
                best = (gpus, "optimal" if optimal else "feasible")
        if mip_bound is not None:
            bound = max(bound, mip_bound)
        if optimal and best is not None:
            status = "optimal"
    if best is None:
        # Nothing met the hard constraints (e.g. the budget is already spent): run nothing.
        best = ({job.job_id: (0,) * problem.num_slots for job in problem.jobs}, "heuristic")
    if status != "optimal":
        status = best[1]
    return make_plan(
        problem,
        best[0],
        status=status,
        policy="greenflow",
        solve_s=time.perf_counter() - started,
        bound=bound,
        notes=(f"lp_deadline_misses={float(lp.missed.sum()):.3f}",),
    )


def _near_deadline_mip(
    problem: AllocationProblem,
    arrays: PlanArrays,
    lp: LpResult,
    prefer: dict[str, int] | None,
    until: float,
    seed: int,
) -> dict[str, tuple[int, ...]] | None:
    """Exact MIP over the slots up to the last deadline inside the horizon, LP rounding after.

    Deadlines in the trace are mostly a few slots away, where rounding errors cost most; a MIP
    over just those slots stays small however long the horizon is.
    """
    deadlines = [
        j.deadline_s
        for j in problem.jobs
        if j.deadline_s is not None and 0 < j.deadline_s < problem.horizon_s
    ]
    if not deadlines:
        return None
    slots = int(np.ceil(max(deadlines) / problem.slot_s))
    if slots >= problem.num_slots or int(arrays.valid.sum()) * slots * 2 > EXACT_MAX_BINARIES * 4:
        return None
    sub = replace(
        problem,
        capacity_gpus=problem.capacity_gpus[:slots],
        intensity_g_per_kwh=problem.intensity_g_per_kwh[:slots],
    )
    left_s = until - time.perf_counter()
    if left_s <= 0:
        return None
    head, _, _ = solve_mip(sub, PlanArrays(sub), None, left_s, seed)
    if head is None:
        return None
    return trim_after_finish(problem, round_lp(problem, arrays, lp, prefer, "ceil", prefix=head))


def _feasible(problem: AllocationProblem, gpus: dict[str, tuple[int, ...]]) -> bool:
    ev = evaluate_gpus(problem, gpus)
    return ev.capacity_ok and ev.allowed_ok and ev.budget_ok


@dataclass(frozen=True)
class AdmissionDecision:
    """Whether a new job is admitted, with its deadline guarantee and the reason."""

    admitted: bool
    guaranteed: bool  # the deadline is planned to be met
    reason: str
    plan: AllocationPlan | None


def admit(
    problem: AllocationProblem,
    new_job: JobSpec,
    *,
    time_limit_s: float = 2.0,
    seed: int = 0,
    policy: Callable[..., AllocationPlan] | None = None,
) -> AdmissionDecision:
    """Admit `new_job` if the policy's plan meets its deadline without breaking admitted ones."""
    plan_with = solve if policy is None else policy
    base = (
        plan_with(problem, previous=None, time_limit_s=time_limit_s / 2, seed=seed)
        if problem.jobs
        else None
    )
    met_before = {k for k, v in base.deadline_met.items() if v} if base else set()
    trial = AllocationProblem(
        start_at=problem.start_at,
        slot_s=problem.slot_s,
        capacity_gpus=problem.capacity_gpus,
        intensity_g_per_kwh=problem.intensity_g_per_kwh,
        jobs=(*problem.jobs, new_job),
        pue=problem.pue,
        budget_periods=problem.budget_periods,
        budget_mode=problem.budget_mode,
        carbon_price_s_per_kg=problem.carbon_price_s_per_kg,
        change_cost_s=problem.change_cost_s,
    )
    plan = plan_with(trial, previous=None, time_limit_s=time_limit_s / 2, seed=seed)
    if new_job.deadline_s is None:
        return AdmissionDecision(True, False, "no deadline", plan)
    broken = sorted(k for k in met_before if not plan.deadline_met.get(k, False))
    if plan.deadline_met.get(new_job.job_id, False) and not broken:
        return AdmissionDecision(True, True, "deadline can be met", plan)
    if broken:
        why = f"meeting it would break the deadlines of admitted jobs {', '.join(broken[:5])}"
    else:
        why = plan.missed_reasons.get(new_job.job_id, "no plan meets the deadline")
    if new_job.best_effort:
        return AdmissionDecision(True, False, f"queued best-effort: {why}", plan)
    return AdmissionDecision(False, False, f"rejected: {why}", plan)
