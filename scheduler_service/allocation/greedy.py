"""Fast primal heuristic: deadline reservations, then per-slot GPU pricing by marginal value.

Why this exists: at 1,000+ jobs the horizon LP alone takes seconds, so `solve` needs a plan that
is good without it. The objective values one sample of job j done in slot t at
    priority_j * slot_s * ((T - t) + tail_slots_j) / remaining_j
(fractional completion: the work counts at every later slot end, and it shortens the tail past the
horizon), so within a slot the jobs compete for GPUs by value per GPU. Each slot is solved as a
small resource-priced problem: every job picks the option maximising value - price * GPUs, the
price found by bisection so the slot's GPUs fit, then spare GPUs go to the best upgrades per GPU.
Deadline jobs that can meet their deadline get a reservation first (latest deadline first, as
late as possible, the slowest fixed count that covers the work; see reserve_deadlines), and never
fall below what the reservation still needs, so capacity taken by other jobs cannot break a
deadline the reservation secured. See docs/allocation.md for measured figures.
Everything per slot is numpy over jobs x options: no Python loop over jobs inside the slot loop.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler_service.allocation.problem import AllocationProblem, BudgetMode, PlanArrays
from scheduler_service.allocation.slots import SlotState, fit_slot

# Bisection steps on the per-slot GPU price (2^-40 of the price range: far below one GPU's value).
PRICE_STEPS = 40
# Upgrade rounds that hand out GPUs the price left spare (each round gives one job one step).
FILL_ROUNDS = 64
# How much a reserved deadline job's urgency (rate still needed / top rate) raises its worth.
URGENCY_WEIGHT = 2.0


@dataclass(frozen=True)
class GreedyRound:
    """One greedy round: option per job and slot (-1 = off) and each slot's GPU price."""

    options: np.ndarray  # [jobs, slots]
    gpu_price: np.ndarray  # [slots] objective units per GPU for the slot; 0 where GPUs were spare


def finish_worth(
    problem: AllocationProblem, arrays: PlanArrays, rnd: GreedyRound, completion_s: np.ndarray
) -> np.ndarray:
    """Per job: what its last samples' GPU time is worth per sample at its finishing slot's price.

    Work done earlier lets a job finish earlier and hand back its GPUs in that slot, so a job
    finishing inside the horizon gains this on top of the slots it saves (the LP's reduced cost:
    at the optimum a finishing job's work is worth the finishing slot's GPU price per sample).
    `completion_s`: finish time per job (nan where it does not finish in the horizon).
    """
    finished = np.isfinite(completion_s)
    last = np.clip(
        np.ceil(np.where(finished, completion_s, 0.0) / problem.slot_s) - 1,
        0,
        problem.num_slots - 1,
    ).astype(np.int64)
    rows = np.arange(arrays.num_jobs)
    k = rnd.options[rows, last]
    on = finished & (k >= 0)
    kk = np.maximum(k, 0)
    per_sample = (
        rnd.gpu_price[last] * arrays.gpus[rows, kk] / (arrays.throughput[rows, kk] * problem.slot_s)
    )
    return np.where(on, per_sample, 0.0)


def effective_deadlines(
    problem: AllocationProblem, arrays: PlanArrays
) -> tuple[np.ndarray, np.ndarray]:
    """Per job: (time by which the in-horizon work must be done, samples needed by then).

    A deadline past the horizon leaves `max rate x (deadline - horizon)` samples for after it.
    Jobs without a deadline get (inf, 0).
    """
    end_s = np.full(arrays.num_jobs, np.inf)
    need = np.zeros(arrays.num_jobs)
    horizon_s = problem.horizon_s
    for i, job in enumerate(problem.jobs):
        if job.deadline_s is None:
            continue
        if job.deadline_s >= horizon_s:
            end_s[i] = horizon_s
            need[i] = max(
                0.0, job.remaining_samples - arrays.max_throughput[i] * (job.deadline_s - horizon_s)
            )
        else:
            end_s[i] = max(job.deadline_s, 0.0)
            need[i] = job.remaining_samples
    return end_s, need


def slot_durations(problem: AllocationProblem, end_s: np.ndarray) -> np.ndarray:
    """[jobs, slots] seconds of each slot that lie before the job's deadline (0 after it)."""
    starts = np.arange(problem.num_slots) * problem.slot_s
    finite = np.where(np.isfinite(end_s), end_s, problem.horizon_s)
    return np.clip(finite[:, None] - starts[None, :], 0.0, problem.slot_s)


def reserve_deadlines(
    problem: AllocationProblem,
    arrays: PlanArrays,
    protect: np.ndarray,
    order: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Deadline reservations: (option per job and slot, -1 = none; jobs actually protected).

    Jobs are taken in `order` (default: latest deadline first; see `overload_orders` for the
    orders tried when not all fit); each tries the slowest fixed count that covers its work
    before the deadline, then the largest count that fits each slot, placed as late as possible;
    a job neither fits loses its protection (its deadline is then left to the per-slot pricing).
    """
    num_jobs, num_slots = arrays.num_jobs, problem.num_slots
    end_s, need = effective_deadlines(problem, arrays)
    dur = slot_durations(problem, end_s)
    cap_left = np.asarray(problem.capacity_gpus, dtype=np.int64).copy()
    reserved = np.full((num_jobs, num_slots), -1, dtype=np.int64)
    protected = np.zeros(num_jobs, dtype=bool)
    n_valid = arrays.valid.sum(axis=1)
    if order is None:
        order = sorted(np.flatnonzero(protect & (need > 0)), key=lambda i: (-end_s[i], i))
    for i in order:
        span = np.flatnonzero(dur[i] > 0)
        if len(span) == 0 or not protect[i] or need[i] <= 0:
            continue
        thr = arrays.throughput[i, : n_valid[i]]
        gpus = arrays.gpus[i, : n_valid[i]]
        total_s = float(dur[i, span].sum())
        # The slowest fixed count that covers the need, placed slot by slot latest first, then
        # the largest count that fits each slot (-1). Measured on the 1,000 x 48 bench: choosing
        # among placements by GPU-slots booked instead (also without a partial deadline slot)
        # did worse, 8.8 M vs 8.6 M: late slots are the cheap ones.
        for fixed in [*range(len(thr)), -1]:
            if fixed >= 0 and thr[fixed] * total_s < need[i] * (1 - 1e-9):
                continue
            trial = _place(thr, gpus, dur[i], span[::-1], cap_left, need[i], fixed)
            if trial is not None:
                on = trial >= 0
                reserved[i, on] = trial[on]
                cap_left[on] -= gpus[trial[on]]
                protected[i] = True
                break
    return reserved, protected


def overload_orders(
    problem: AllocationProblem, arrays: PlanArrays, protect: np.ndarray
) -> list[list[int]]:
    """Reservation orders to try when not every deadline fits: narrowest reservations first.

    With deadlines close to the fastest run time a reservation is nearly a rectangle from now
    to the deadline, and every such rectangle crosses the first slot, so the most of them fit
    when the thinnest go first. "Thin" is measured three ways, each of which kept the most
    deadlines on some bench case (none on all): fewest GPUs on average over the window
    (least GPU-seconds / window seconds); fewest GPU-slots per window slot in the reservation
    the job alone would get (whole slots booked); the fewest GPUs that reservation runs at.
    """
    end_s, need = effective_deadlines(problem, arrays)
    dur = slot_durations(problem, end_s)
    window_s = dur.sum(axis=1)
    covers = arrays.valid & (arrays.throughput * window_s[:, None] >= need[:, None] * (1 - 1e-9))
    spread = np.where(
        covers, need[:, None] / np.maximum(arrays.throughput, 1e-12) * arrays.gpus, np.inf
    ).min(axis=1) / np.maximum(window_s, 1e-9)
    candidates = [int(i) for i in np.flatnonzero(protect & (need > 0))]
    # The reservation each job alone would get at each covering count (latest slots first, the
    # earliest of them at the smallest count that covers the rest), in closed form: only the
    # deadline's slot is partial (`last_s` of it lies before the deadline).
    thr, gpus = np.maximum(arrays.throughput, 1e-12), arrays.gpus
    window_slots = (dur > 0).sum(axis=1)
    last_s = dur[np.arange(arrays.num_jobs), np.maximum(window_slots - 1, 0)][:, None]
    slot_s = problem.slot_s
    full = np.ceil((need[:, None] - thr * last_s) / (thr * slot_s) - 1e-9)
    slots_used = 1 + np.maximum(full, 0)  # [jobs, options]
    rest = need[:, None] - thr * np.where(slots_used > 1, last_s + (slots_used - 2) * slot_s, 0.0)
    rest_s = np.where(slots_used > 1, slot_s, last_s)
    # Smallest count k <= the fixed one that covers the rest in that slot.
    fits = (thr[:, None, :] * rest_s[:, :, None] >= rest[:, :, None] * (1 - 1e-9)) & (
        np.arange(thr.shape[1])[None, None, :] <= np.arange(thr.shape[1])[None, :, None]
    )
    first_gpus = np.take_along_axis(gpus, fits.argmax(axis=2), axis=1)
    booked = np.where(covers, gpus * (slots_used - 1) + first_gpus, np.inf)
    per_slot = booked.min(axis=1) / np.maximum(window_slots, 1)  # GPU-slots per window slot
    peak = gpus[np.arange(arrays.num_jobs), booked.argmin(axis=1)]  # that reservation's count
    return [
        sorted(candidates, key=lambda i: (key[i], end_s[i], i)) for key in (spread, per_slot, peak)
    ]


def best_reservation(
    problem: AllocationProblem, arrays: PlanArrays, protect: np.ndarray
) -> np.ndarray:
    """The reservation that protects the most deadline jobs: latest deadline first when all
    fit, else the best of that and the `overload_orders`."""
    best, kept = reserve_deadlines(problem, arrays, protect)
    if kept.sum() == (protect & (effective_deadlines(problem, arrays)[1] > 0)).sum():
        return best  # everything fits: no need to choose
    most = int(kept.sum())
    for order in overload_orders(problem, arrays, protect):
        trial, trial_kept = reserve_deadlines(problem, arrays, protect, order)
        if trial_kept.sum() > most:
            best, most = trial, int(trial_kept.sum())
    return best


def _place(
    thr: np.ndarray,
    gpus: np.ndarray,
    dur: np.ndarray,
    slots: np.ndarray,
    cap_left: np.ndarray,
    need: float,
    fixed: int,
) -> np.ndarray | None:
    """One job's reservation over `slots` in that order at count `fixed` (-1: largest fitting).

    Each slot takes the smallest count up to the cap that covers what is left, else the cap;
    None when the need is not covered.
    """
    trial = np.full(len(cap_left), -1, dtype=np.int64)
    # Plain floats and ints: a job has a handful of options, and numpy's per-call cost on arrays
    # that small made the reservations of 1,500 deadline jobs take seconds.
    thr_l, gpus_l, dur_l, cap_l = thr.tolist(), gpus.tolist(), dur.tolist(), cap_left.tolist()
    left = need
    for t in slots.tolist():
        top = fixed if fixed >= 0 else bisect_right(gpus_l, cap_l[t]) - 1
        if top < 0 or gpus_l[top] > cap_l[t]:
            continue
        d = dur_l[t]
        goal = left * (1 - 1e-9)
        k = next((i for i in range(top + 1) if thr_l[i] * d >= goal), top)
        trial[t] = k
        left -= thr_l[k] * d
        if left <= need * 1e-9:
            return trial
    return None


def greedy_plan(
    problem: AllocationProblem,
    arrays: PlanArrays,
    protect: np.ndarray,
    prefer: np.ndarray | None = None,
    finish_slots: np.ndarray | None = None,
    reserved: np.ndarray | None = None,
    chase: bool = False,
    finish_worth: np.ndarray | None = None,
) -> GreedyRound:
    """Option index per job and slot (-1 = off) from reservations + per-slot GPU pricing.

    `protect`: jobs whose deadline should be reserved (those that can meet it alone).
    `prefer`: option each job ran at before slot 0 (-1 = off); keeping it saves a change.
    `finish_slots`: expected finish per job (in slots, from an earlier pass or the previous plan);
    work then is valued by the slots it saves before that finish instead of before the horizon's
    end, which stops the greedy from overfeeding jobs that finish soon anyway.
    `reserved`: a `best_reservation` to reuse across rounds (computed when None).
    `chase`: deadline jobs that can meet their deadline alone but got no reservation are valued
    at the miss weight per unit of the work their deadline needs, so spare GPUs go to them first.
    `finish_worth`: per job, extra worth per sample of finishing sooner (with `finish_slots`;
    see `finish_worth`).
    """
    num_jobs, num_slots = arrays.num_jobs, problem.num_slots
    slot_s = problem.slot_s
    rows = np.arange(num_jobs)
    state = SlotState(problem, arrays)
    if reserved is None:
        reserved = best_reservation(problem, arrays, protect)
    end_s, need = effective_deadlines(problem, arrays)
    dur = slot_durations(problem, end_s)
    # Samples the reservation still delivers after slot t (so slot t's floor can be lower).
    res_on = reserved >= 0
    res_work = np.where(
        res_on, arrays.throughput[rows[:, None], np.maximum(reserved, 0)] * dur, 0.0
    )
    res_after = np.cumsum(res_work[:, ::-1], axis=1)[:, ::-1] - res_work
    has_res = res_on.any(axis=1)
    # Seconds of each job's deadline window from slot t on (for its urgency below).
    window_left_s = np.maximum(np.cumsum(dur[:, ::-1], axis=1)[:, ::-1], 1e-9)

    valid = arrays.valid
    gpus = arrays.gpus.astype(float)
    thr = arrays.throughput
    power = arrays.power_w
    price = problem.carbon_price_s_per_kg
    value_per_sample = arrays.priority / arrays.remaining  # times slot_s * (T - t + tail) below
    tail = arrays.tail_slots
    done = np.zeros(num_jobs)
    prev = (
        np.array([j.index_of(j.current_gpus) for j in problem.jobs], dtype=np.int64)
        if prefer is None
        else prefer.astype(np.int64)
    )
    plan = np.full((num_jobs, num_slots), -1, dtype=np.int64)
    gpu_price = np.zeros(num_slots)
    k_idx = np.arange(arrays.num_options)[None, :]
    reserve_kg = budget_reserve(problem, state)
    chase_weight = None
    if chase:
        unreserved = protect & ~has_res & (need > 0)
        chase_weight = np.where(
            unreserved, problem.deadline_miss_cost_s() / np.maximum(need, 1e-12), 0.0
        )
    for t in range(num_slots):
        left = arrays.remaining - done
        active = left > arrays.remaining * 1e-9
        if finish_slots is None:
            worth = value_per_sample * slot_s * ((num_slots - t) + tail)
        else:
            # Work done now instead of at the job's expected finish saves the slots between.
            worth = value_per_sample * slot_s * np.maximum(finish_slots - t, 1.0)
            if finish_worth is not None:
                worth = worth + finish_worth
        # A reserved deadline job must do its work before its deadline anyway, mostly at high
        # counts that earn little per GPU, so priced like the others it waits until its floors
        # crowd everyone out near the deadlines. Its work is worth more the larger the share of
        # its top rate its deadline still needs on average (measured: 1,000 x 48 x 2,048 with
        # 12-48 h jobs 9.14 -> 7.71 % above the LP bound, default mix 8.86 -> 8.79 %).
        urgency = np.where(
            has_res,
            np.maximum(need - done, 0.0) / window_left_s[:, t] / arrays.max_throughput,
            0.0,
        )
        worth = worth * (1.0 + URGENCY_WEIGHT * urgency)
        value = worth[:, None] * np.minimum(thr * slot_s, left[:, None])
        if chase_weight is not None:
            before = np.minimum(thr * dur[:, t][:, None], np.maximum(need - done, 0.0)[:, None])
            value += chase_weight[:, None] * before
        if price > 0:
            value -= price * power * state.kg_per_w[t]
        # Keeping the count of the slot before saves one change.
        value += problem.change_cost_s * (k_idx == prev[:, None])
        off_value = problem.change_cost_s * (prev < 0)
        # Floor: what the reservation still needs from this slot (deadline-protected jobs).
        need_here = np.where(
            has_res & active & (dur[:, t] > 0),
            np.maximum(need - done - res_after[:, t], 0.0) / np.maximum(dur[:, t], 1e-9),
            0.0,
        )
        floor_ok = thr >= need_here[:, None] * (1 - 1e-9)
        # Behind the reservation (capacity changed): the largest count is the best effort.
        top = valid.sum(axis=1) - 1
        behind = ~np.any(floor_ok & valid, axis=1)
        floor_ok |= behind[:, None] & (k_idx == top[:, None])
        allowed = valid & active[:, None] & floor_ok
        off_allowed = ~(need_here > 0) | ~active
        fits_cap = gpus <= problem.capacity_gpus[t]
        allowed &= fits_cap
        masked = np.where(allowed, value, -np.inf)
        off_score = np.where(off_allowed, off_value, -np.inf)
        cap = float(problem.capacity_gpus[t])
        # A tiny price breaks ties towards fewer GPUs (options past finishing are worth no more).
        lo = 1e-9 * float(np.abs(value).max(initial=1.0))
        choice = _pick(masked, gpus, off_score, lo)
        if _used(choice, gpus) > cap:
            per_gpu = np.divide(value, gpus, out=np.zeros_like(value), where=allowed)
            hi = float(per_gpu.max(initial=0.0)) + 1.0
            # The same bisection as picking at every step, with each step a lookup instead of
            # a pick over all jobs (at 5,000 jobs x 288 slots the picks took most of a round).
            used_at = UsedCurve(masked, gpus, off_score, choice)
            for _ in range(PRICE_STEPS):
                mid = 0.5 * (lo + hi)
                if used_at(mid) > cap:
                    lo = mid
                else:
                    hi = mid
            choice = _pick(masked, gpus, off_score, hi)
            gpu_price[t] = hi
        budget = state.slot_budget_kg(t, None if reserve_kg is None else reserve_kg[:, t])
        if _used(choice, gpus) > cap or (
            state.periods
            and float(np.where(choice >= 0, power[rows, np.maximum(choice, 0)], 0.0).sum())
            * state.kg_per_w[t]
            > budget
        ):
            # Floors alone overfill (capacity dropped) or the budget binds: shed the least useful.
            choice = fit_slot(
                state, t, choice, active, worth, worth, budget, fill=False, min_rate=need_here
            )
        choice = _fill_spare(problem, t, choice, value, gpus, power, allowed, cap, budget)
        plan[:, t] = choice
        on = choice >= 0
        rate = np.where(on, thr[rows, np.maximum(choice, 0)], 0.0)
        watts = np.where(on, power[rows, np.maximum(choice, 0)], 0.0)
        state.charge(t, float(watts.sum() * state.kg_per_w[t]))
        done = np.minimum(done + rate * slot_s, arrays.remaining)
        prev = np.where(active, choice, -1)
    return GreedyRound(plan, gpu_price)


def _pick(masked: np.ndarray, gpus: np.ndarray, off_score: np.ndarray, price: float) -> np.ndarray:
    """Each job's best option at a GPU price (-1 = off); `masked` is -inf where not allowed."""
    score = masked - price * gpus
    best = score.argmax(axis=1)
    best_score = np.take_along_axis(score, best[:, None], axis=1)[:, 0]
    return np.where(best_score > off_score, best, -1)


class UsedCurve:
    """GPUs `_pick` books at each price from the one `start` was picked at on, as a step function.

    As the price rises each job moves to options with fewer GPUs, at most once per option: from
    its option c, option k < c (fewer GPUs) overtakes it at price (m_c - m_k) / (g_c - g_k) and
    "off" at (m_c - off) / g_c, where m is the job's masked value; ties go as `_pick` breaks
    them (the fewer GPUs; off over on). Walking every job down its options once gives all the
    price steps, so the GPUs booked at a price are one binary search, not a pick over all jobs.
    """

    def __init__(
        self, masked: np.ndarray, gpus: np.ndarray, off_score: np.ndarray, start: np.ndarray
    ) -> None:
        self.start_gpus = _used(start, gpus)
        # Only the jobs still moving are walked on: each pass works on fewer rows.
        rows = np.flatnonzero(start >= 0)
        m, g, off, cur = masked[rows], gpus[rows], off_score[rows], start[rows]
        floor = np.full(len(rows), -np.inf)  # a job's steps come in rising price order
        prices: list[np.ndarray] = []
        steps: list[np.ndarray] = []
        for _ in range(masked.shape[1] + 1):
            if not len(rows):
                break
            here = np.arange(len(rows))
            m_c, g_c = m[here, cur], g[here, cur]
            fewer = np.isfinite(m) & (g < g_c[:, None])
            gap_g = np.where(fewer, g_c[:, None] - g, 1.0)
            cross = np.where(fewer, (m_c[:, None] - np.where(fewer, m, 0.0)) / gap_g, np.inf)
            best = cross.min(axis=1)
            # Among options overtaking at the same price the one with the fewest GPUs wins.
            k = np.where(fewer & (cross == best[:, None]), g, np.inf).argmin(axis=1)
            finite_off = np.isfinite(off)
            to_off = np.where(finite_off, (m_c - np.where(finite_off, off, 0.0)) / g_c, np.inf)
            goes_off = to_off <= best
            price = np.maximum(np.where(goes_off, to_off, best), floor)
            step = np.isfinite(price)
            new_g = np.where(goes_off, 0.0, g[here, k])
            prices.append(price[step])
            steps.append((new_g - g_c)[step])
            keep = step & ~goes_off
            m, g, off, cur = m[keep], g[keep], off[keep], k[keep]
            floor, rows = price[keep], rows[keep]
        all_prices = np.concatenate(prices) if prices else np.zeros(0)
        order = np.argsort(all_prices, kind="stable")
        self.prices = all_prices[order]
        self.change = np.cumsum(np.concatenate(steps)[order]) if prices else np.zeros(0)

    def __call__(self, price: float) -> float:
        """GPUs booked at `price` (at least the start's price)."""
        n = int(np.searchsorted(self.prices, price, side="right"))
        return self.start_gpus + (float(self.change[n - 1]) if n else 0.0)


def _used(choice: np.ndarray, gpus: np.ndarray) -> float:
    """GPUs a choice vector books."""
    taken = np.take_along_axis(gpus, np.maximum(choice, 0)[:, None], axis=1)[:, 0]
    return float(np.where(choice >= 0, taken, 0.0).sum())


def budget_reserve(problem: AllocationProblem, state: SlotState) -> np.ndarray | None:
    """[periods, slots] kg of each hard budget period kept back for the slots after t.

    A period's budget is spread over its slots in proportion to 1 / intensity^2, so cleaner
    slots get more of it; a slot may use what the period has left minus this reserve.
    """
    if not state.periods:
        return None
    intensity = np.maximum(np.asarray(problem.intensity_g_per_kwh, dtype=float), 1e-3)
    weight = 1.0 / intensity**2
    out = np.zeros((len(state.periods), problem.num_slots))
    for n, (period, share) in enumerate(state.periods):
        mass = weight * share
        total = float(mass.sum())
        if total <= 0:
            continue
        after = np.cumsum(mass[::-1])[::-1] - mass  # mass of the slots after t
        out[n] = max(period.budget_left_kg, 0.0) * after / total
    return out


def _fill_spare(
    problem: AllocationProblem,
    t: int,
    choice: np.ndarray,
    value: np.ndarray,
    gpus: np.ndarray,
    power: np.ndarray,
    allowed: np.ndarray,
    cap: float,
    budget_kg: float,
) -> np.ndarray:
    """Give GPUs the price left unused to the upgrades with the best extra value per GPU."""
    rows = np.arange(len(choice))
    kg_per_w = float(problem.slot_emissions_kg_per_w()[t])
    hard = problem.budget_mode is BudgetMode.HARD and bool(problem.budget_periods)
    choice = choice.copy()
    for _ in range(FILL_ROUNDS):
        on = choice >= 0
        cur_g = np.where(on, gpus[rows, np.maximum(choice, 0)], 0.0)
        cur_v = np.where(on, value[rows, np.maximum(choice, 0)], 0.0)
        cur_w = np.where(on, power[rows, np.maximum(choice, 0)], 0.0)
        spare = cap - float(cur_g.sum())
        if spare < 1:
            break
        extra_g = gpus - cur_g[:, None]
        gain = value - cur_v[:, None]
        ok = allowed & (extra_g > 0) & (extra_g <= spare) & (gain > 0)
        if hard:
            room_w = budget_kg / kg_per_w - float(cur_w.sum()) if kg_per_w > 0 else np.inf
            ok &= (power - cur_w[:, None]) <= room_w
        if not ok.any():
            break
        density = np.where(ok, gain / np.maximum(extra_g, 1.0), -np.inf)
        flat = int(density.argmax())
        j, k = divmod(flat, density.shape[1])
        choice[j] = k
    return choice
