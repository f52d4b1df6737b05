"""Integer plans from the LP relaxation: slot-by-slot rounding, the near-deadline MIP, and the
deadline repair that moves GPUs to savable deadline jobs (docs/allocation.md, steps 3-5)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from scheduler_service.allocation.highs import LpResult, solve_mip
from scheduler_service.allocation.problem import (
    AllocationProblem,
    BudgetMode,
    PlanArrays,
    evaluate_gpus,
    trim_after_finish,
)
from scheduler_service.allocation.slots import SlotState, fit_slot
from scheduler_service.allocation.steps import TUNING


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
    max_trials: int = TUNING.repair_max_trials,
) -> tuple[dict[str, tuple[int, ...]], int]:
    """Give GPUs to savable jobs that miss their deadline, taking them from jobs that can spare
    them, as long as no met deadline breaks; stops after `max_trials` evaluated moves.

    Returns the plan and the moves it tried."""
    plan = {k: list(v) for k, v in gpus.items()}
    trials = max_trials
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
            for g in job.allowed_gpus:
                if g <= plan[job.job_id][t]:
                    continue
                trials -= 1
                if trials < 0:
                    return {k: tuple(v) for k, v in plan.items()}, max_trials
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
    return {k: tuple(v) for k, v in plan.items()}, max_trials - trials


def lp_deadline_met(problem: AllocationProblem, lp: LpResult) -> np.ndarray:
    """Per job: the LP relaxation meets its deadline (False for jobs without one)."""
    has = np.array([j.deadline_s is not None for j in problem.jobs], dtype=bool)
    return has & (lp.missed <= 1e-6)


def state_opt(arrays: PlanArrays) -> tuple[np.ndarray, np.ndarray]:
    """(job, option) index arrays of every valid option, in model order."""
    return np.nonzero(arrays.valid)  # type: ignore[return-value]


def near_deadline_mip(
    problem: AllocationProblem,
    arrays: PlanArrays,
    lp: LpResult,
    prefer: dict[str, int] | None,
    slots: int,
    seed: int,
) -> dict[str, tuple[int, ...]] | None:
    """Exact MIP over the first `slots` slots (up to the last deadline inside the horizon, see
    `near_deadline_slots`), LP rounding after.

    Deadlines in the trace are mostly a few slots away, where rounding errors cost most; a MIP
    over just those slots stays small however long the horizon is.
    """
    sub = replace(
        problem,
        capacity_gpus=problem.capacity_gpus[:slots],
        intensity_g_per_kwh=problem.intensity_g_per_kwh[:slots],
    )
    head, _, _ = solve_mip(sub, PlanArrays(sub), seed)
    if head is None:
        return None
    return trim_after_finish(problem, round_lp(problem, arrays, lp, prefer, "ceil", prefix=head))
