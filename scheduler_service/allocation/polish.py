"""Local search over a finished plan: exchange GPUs between jobs slot by slot, exact deltas.

Why this exists: the greedy (greedy.py) decides each slot with estimated values of work (finish
times from the round before), so its plan can leave a GPU with a job whose objective gains less
from it than another job in the same slot would. The objective is a sum of per-job terms
(completion area, tail, carbon, changes, miss) coupled only through each slot's capacity and the
hard budget periods, so the exact change of the objective from rewriting one job's row is that
job's own cost difference. Each pass builds, for every job and every slot up to its finish, one
step up ("buy": more GPUs in slot t, the row trimmed after the earlier finish and its finishing
slot shrunk) and one step down ("sell": fewer GPUs in slot t, the lost work re-finished right
after the old finish, or in the first later slot with room), evaluates all rows with numpy at
once, then applies free gains, then the best buys by gain per GPU, each paid for by the
cheapest sells in the slot short of GPUs and, when a sell's re-finish leaves a later slot
short, by sells there (a short chain forward in time). A move set is applied only when it lowers
the objective and fits capacity and budget in every slot, at most one move per job and pass, so
the objective never gets worse and the constraints the start plan kept stay kept. Passes and
the work per pass are counts (from the problem's size and the time limit, see
`steps.plan_steps`), never a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler_service.allocation.problem import AllocationProblem, BudgetMode, PlanArrays

# Relative tolerance of the objective comparisons (float noise must not count as a gain).
EPS_REL = 1e-12
# Python work per pass is bounded by counts (not a clock): buys tried per pass (best gain per
# GPU first; the rest wait for the next pass), slots one buy's chain of sells may reach (each
# sell may leave a later slot short), and the cheapest sells looked at per chain step.
MAX_BUYS_PER_PASS = 1024
MAX_CHAIN = 6
SELL_POOL = 32
# Size estimate of a pass: 3 candidate rows per job-slot up to the job's finish, each evaluated
# over the horizon (cells), plus the bounded Python pairing. Measured 2026-11-24 at load 1.4-2,
# 1,000 jobs x 48 slots: 0.8-2.6e-7 s per cell (1.1 M cells at 0.5-12 h of work per job on 2,048
# GPUs: 0.18-0.29 s; 4.8 M at 12-48 h: 0.41-0.95 s), so the constant is the high end.
SECONDS_PER_CELL = 2e-7
SECONDS_PER_BUY = 1e-4
SECONDS_PER_SLOT = 1e-3


def polish_pass_s(candidates: int, num_slots: int) -> float:
    """Size estimate of one pass over `candidates` job-slots (seconds)."""
    return (
        3 * candidates * num_slots * SECONDS_PER_CELL
        + min(candidates, MAX_BUYS_PER_PASS) * SECONDS_PER_BUY
        + num_slots * SECONDS_PER_SLOT
    )


@dataclass(frozen=True)
class _Ctx:
    """Per-job tables of one problem, padded to rectangles (see PlanArrays)."""

    thr: np.ndarray  # [J, K] samples/s
    gpus: np.ndarray  # [J, K]
    power: np.ndarray  # [J, K] W
    valid: np.ndarray  # [J, K]
    n_opts: np.ndarray  # [J]
    remaining: np.ndarray
    weight_s: np.ndarray  # priority * slot_s
    tail_slots: np.ndarray
    tail_kg: np.ndarray
    max_thr: np.ndarray
    deadline_s: np.ndarray  # inf without deadline
    current: np.ndarray  # GPUs before slot 0
    kg_per_w: np.ndarray  # [T]
    capacity: np.ndarray  # [T]
    slot_s: float
    price: float
    change_s: float
    miss_s: float
    horizon_s: float
    shares: np.ndarray  # [P, T] hard budget periods (empty when none)
    budgets_kg: np.ndarray  # [P]
    # The tables with an "off" column (0) in front, flattened: one np.take per lookup.
    thr_flat: np.ndarray
    gpus_flat: np.ndarray
    power_flat: np.ndarray


def _context(problem: AllocationProblem, arrays: PlanArrays) -> _Ctx:
    periods = problem.period_slots() if problem.budget_mode is BudgetMode.HARD else []
    num_slots = problem.num_slots
    shares = np.array([s for _, s in periods]).reshape(len(periods), num_slots)
    return _Ctx(
        thr=arrays.throughput,
        gpus=arrays.gpus,
        power=arrays.power_w,
        valid=arrays.valid,
        n_opts=arrays.valid.sum(axis=1),
        remaining=arrays.remaining,
        weight_s=arrays.priority * problem.slot_s,
        tail_slots=arrays.tail_slots,
        tail_kg=arrays.tail_kg,
        max_thr=arrays.max_throughput,
        deadline_s=np.array(
            [np.inf if j.deadline_s is None else j.deadline_s for j in problem.jobs], dtype=float
        ),
        current=np.array([j.current_gpus for j in problem.jobs], dtype=np.int64),
        kg_per_w=problem.slot_emissions_kg_per_w(),
        capacity=np.asarray(problem.capacity_gpus, dtype=np.int64),
        slot_s=problem.slot_s,
        price=problem.carbon_price_s_per_kg,
        change_s=problem.change_cost_s,
        miss_s=problem.deadline_miss_cost_s(),
        horizon_s=problem.horizon_s,
        shares=shares,
        budgets_kg=np.array([p.budget_left_kg for p, _ in periods], dtype=float),
        thr_flat=_with_off(arrays.throughput),
        gpus_flat=_with_off(arrays.gpus),
        power_flat=_with_off(arrays.power_w),
    )


def _with_off(table: np.ndarray) -> np.ndarray:
    """A [jobs, options] table with a 0 column for "off" in front, flattened."""
    return np.concatenate([np.zeros((table.shape[0], 1), dtype=table.dtype), table], axis=1).ravel()


def _table(ctx: _Ctx, flat: np.ndarray, jobs: np.ndarray, opts: np.ndarray) -> np.ndarray:
    """A flattened table (`_with_off`) per cell of `opts` (rows of `jobs`), 0 where off."""
    return np.take(flat, jobs[:, None] * (ctx.thr.shape[1] + 1) + (opts + 1))


def _finish(ctx: _Ctx, jobs: np.ndarray, opts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(finishing slot per row, T when unfinished; work done before each slot)."""
    rate = _table(ctx, ctx.thr_flat, jobs, opts)
    work = rate * ctx.slot_s
    before = np.cumsum(work, axis=1) - work
    rem = ctx.remaining[jobs][:, None]
    finishes = (opts >= 0) & (rem - before <= rate * (ctx.slot_s + 1e-9))
    t_fin = np.where(finishes.any(axis=1), finishes.argmax(axis=1), opts.shape[1])
    return t_fin, before


def _costs(ctx: _Ctx, jobs: np.ndarray, opts: np.ndarray) -> np.ndarray:
    """Each row's share of `plan_objective` (the same formulas as `evaluate_gpus`)."""
    num_slots = opts.shape[1]
    rows = np.arange(len(jobs))
    rate = _table(ctx, ctx.thr_flat, jobs, opts)
    power = _table(ctx, ctx.power_flat, jobs, opts)
    counts = _table(ctx, ctx.gpus_flat, jobs, opts)
    rem = ctx.remaining[jobs]
    t_fin, before = _finish(ctx, jobs, opts)
    finished = t_fin < num_slots
    done_after = before + rate * ctx.slot_s
    slots = np.arange(num_slots)[None, :]
    area = np.where(slots < t_fin[:, None], 1.0 - done_after / rem[:, None], 0.0).sum(axis=1)
    done = np.where(finished, rem, done_after[:, -1])
    leftover = np.maximum(0.0, 1.0 - done / rem)
    tf = np.minimum(t_fin, num_slots - 1)
    last_rate = rate[rows, tf]
    # Only a finished job's last slot is divided by (it runs there, so its rate is positive).
    into_s = np.divide(
        rem - before[rows, tf],
        last_rate,
        out=np.zeros_like(last_rate),
        where=finished & (last_rate > 0),
    )
    finish_s = np.where(finished, tf * ctx.slot_s + into_s, np.inf)
    dl = ctx.deadline_s[jobs]
    met = finish_s <= dl + 1e-6
    late = ~finished & (dl >= ctx.horizon_s) & np.isfinite(dl)
    met |= late & (
        done + ctx.max_thr[jobs] * (np.where(late, dl, 0.0) - ctx.horizon_s) >= rem * (1 - 1e-9)
    )
    miss = np.isfinite(dl) & ~met
    prev = np.concatenate([ctx.current[jobs][:, None], counts[:, :-1]], axis=1)
    release = (counts == 0) & (slots > t_fin[:, None])
    changes = ((counts != prev) & ~release).sum(axis=1)
    kg = (power * ctx.kg_per_w[None, :]).sum(axis=1) + leftover * ctx.tail_kg[jobs]
    return (
        ctx.weight_s[jobs] * (area + leftover * ctx.tail_slots[jobs])
        + ctx.price * kg
        + ctx.change_s * changes
        + ctx.miss_s * miss
    )


def _smallest_finishing(
    ctx: _Ctx, jobs: np.ndarray, left: np.ndarray, upto: np.ndarray, window_s: np.ndarray
) -> np.ndarray:
    """Smallest option <= `upto` whose slot's work covers `left` within `window_s` (-1: none)."""
    k = np.arange(ctx.thr.shape[1])[None, :]
    ok = (
        ctx.valid[jobs]
        & (k <= upto[:, None])
        & (ctx.thr[jobs] * (window_s[:, None] + 1e-9) >= left[:, None])
    )
    return np.where(ok.any(axis=1), ok.argmax(axis=1), -1)


def _normalise(ctx: _Ctx, jobs: np.ndarray, opts: np.ndarray, refinish_from: np.ndarray) -> None:
    """In place: re-finish rows that no longer finish (from `refinish_from`, -1 = no), shrink
    the finishing slot to the smallest option that still finishes (and keeps a met deadline),
    and switch the job off after it finishes."""
    num_slots = opts.shape[1]
    rows = np.arange(len(jobs))
    # Re-finish: up to three slots from the old finish, each at the smallest finishing option or
    # the largest one that fits the slot.
    for step in range(3):
        t_fin, before = _finish(ctx, jobs, opts)
        s = refinish_from + step
        need = (refinish_from >= 0) & (t_fin >= num_slots) & (s < num_slots)
        if not need.any():
            break
        r = rows[need]
        sc = s[need]
        left = ctx.remaining[jobs[r]] - before[r, sc]
        fits = ctx.gpus[jobs[r]] <= ctx.capacity[sc][:, None]
        fit_top = np.where(
            (ctx.valid[jobs[r]] & fits).any(axis=1),
            np.where(ctx.valid[jobs[r]] & fits, np.arange(ctx.thr.shape[1])[None, :], -1).max(
                axis=1
            ),
            -1,
        )
        k = _smallest_finishing(ctx, jobs[r], left, fit_top, np.full(len(r), ctx.slot_s))
        k = np.where(k >= 0, k, fit_top)
        opts[r, sc] = np.maximum(opts[r, sc], k)
    t_fin, before = _finish(ctx, jobs, opts)
    fin = t_fin < num_slots
    r = rows[fin]
    tf = t_fin[fin]
    left = ctx.remaining[jobs[r]] - before[r, tf]
    cur = opts[r, tf]
    dl_in = ctx.deadline_s[jobs[r]] - tf * ctx.slot_s
    window = np.clip(dl_in, 0.0, ctx.slot_s)
    rate_now = ctx.thr[jobs[r], np.maximum(cur, 0)]
    meets_now = left / rate_now <= dl_in + 1e-6
    k_dl = _smallest_finishing(ctx, jobs[r], left, cur, window)
    k_any = _smallest_finishing(ctx, jobs[r], left, cur, np.full(len(r), ctx.slot_s))
    opts[r, tf] = np.where(meets_now & (dl_in < ctx.slot_s), np.where(k_dl >= 0, k_dl, cur), k_any)
    slots = np.arange(num_slots)[None, :]
    opts[slots > t_fin[:, None]] = -1


def polish(
    problem: AllocationProblem,
    arrays: PlanArrays,
    plan: np.ndarray,
    passes: int,
    *,
    budget_s: float | None = None,
) -> np.ndarray:
    """Option matrix (-1 = off) no worse on the objective than `plan`, same hard constraints.

    `plan` must keep capacity (and the hard budget, when there is one); see the module doc.
    With `budget_s`, a pass runs only while the size estimates of the passes so far, sized from
    the plan each starts from, stay within it (a count, never a clock).
    """
    ctx = _context(problem, arrays)
    num_jobs = plan.shape[0]
    opts = plan.astype(np.int64).copy()
    all_jobs = np.arange(num_jobs)
    # Trim and shrink finishing slots first (never raises a job's cost beyond a change).
    start = opts.copy()
    _normalise(ctx, all_jobs, start, np.full(num_jobs, -1))
    power_before = _table(ctx, ctx.power_flat, all_jobs, opts)
    power_after = _table(ctx, ctx.power_flat, all_jobs, start)
    keep = (_costs(ctx, all_jobs, start) <= _costs(ctx, all_jobs, opts)) & np.all(
        power_after <= power_before, axis=1
    )
    opts[keep] = start[keep]
    spent_s = 0.0
    for _ in range(passes):
        if budget_s is not None:
            t_fin, _ = _finish(ctx, all_jobs, opts)
            candidates = int(np.minimum(t_fin, opts.shape[1] - 1).sum()) + num_jobs
            spent_s += polish_pass_s(candidates, opts.shape[1])
            if spent_s > budget_s:
                break
        if not _one_pass(ctx, opts):
            break
    return opts


def _one_pass(ctx: _Ctx, opts: np.ndarray) -> bool:
    """One round of buy/sell pairs per slot; whether anything changed."""
    num_jobs, num_slots = opts.shape
    all_jobs = np.arange(num_jobs)
    base = _costs(ctx, all_jobs, opts)
    t_fin, _ = _finish(ctx, all_jobs, opts)
    last = np.minimum(t_fin, num_slots - 1)
    cj, ct = np.nonzero(np.arange(num_slots)[None, :] <= last[:, None])
    cur = opts[cj, ct]
    k_max = ctx.n_opts[cj] - 1
    cand_jobs: list[np.ndarray] = []
    cand_slots: list[np.ndarray] = []
    cand_rows: list[np.ndarray] = []
    used = _table(ctx, ctx.gpus_flat, all_jobs, opts).sum(axis=0)
    spare = ctx.capacity - used
    tight = spare < int(ctx.gpus.max(initial=1))
    # kind 0: buy; 1: sell re-finished right after the old finish; 2: sell re-finished in the
    # first later slot with room for the job's largest count (a pause: the slots in between are
    # full, and re-finishing there would only push GPUs into them).
    for kind in (0, 1, 2):
        new = cur + 1 if kind == 0 else cur - 1
        ok = (new >= -1) & (new <= k_max)
        safe = np.clip(new, 0, ctx.thr.shape[1] - 1)
        ok &= np.where(new >= 0, ctx.gpus[cj, safe] <= ctx.capacity[ct], True)
        if kind > 0:
            # Sells only where GPUs are short (a slot with room for any job's largest count
            # needs none freed) and for jobs that finish (the re-finish needs a finish).
            ok &= (t_fin[cj] < num_slots) & tight[ct]
        j, at = cj[ok], ct[ok]
        rows = opts[j].copy()
        rows[np.arange(len(j)), at] = new[ok]
        if kind == 0:
            refinish_from = np.full(len(j), -1)
        else:
            # From the old finishing slot (the slot after, when the sell is in that slot:
            # otherwise the re-finish would just undo it).
            refinish_from = t_fin[j] + (at == t_fin[j])
            if kind == 2:
                largest = ctx.gpus[j, ctx.n_opts[j] - 1]
                room = (np.arange(num_slots)[None, :] >= refinish_from[:, None]) & (
                    spare[None, :] >= largest[:, None]
                )
                later = np.where(room.any(axis=1), room.argmax(axis=1), num_slots)
                # Where the slot right after has room, this is the sell of kind 1 again.
                keep = later != refinish_from
                j, at, rows, refinish_from = j[keep], at[keep], rows[keep], later[keep]
        _normalise(ctx, j, rows, refinish_from)
        cand_jobs.append(j)
        cand_slots.append(at)
        cand_rows.append(rows)
    jobs = np.concatenate(cand_jobs)
    slot = np.concatenate(cand_slots)
    rows = np.concatenate(cand_rows)
    delta = _costs(ctx, jobs, rows) - base[jobs]
    d_gpus = _table(ctx, ctx.gpus_flat, jobs, rows) - _table(ctx, ctx.gpus_flat, jobs, opts[jobs])
    d_kg = (
        _table(ctx, ctx.power_flat, jobs, rows) - _table(ctx, ctx.power_flat, jobs, opts[jobs])
    ) * ctx.kg_per_w[None, :]
    room_kg = np.zeros(0)
    if len(ctx.budgets_kg):
        spent = (_table(ctx, ctx.power_flat, all_jobs, opts) * ctx.kg_per_w[None, :]).sum(axis=0)
        room_kg = ctx.budgets_kg * (1 + 1e-6) + 1e-9 - ctx.shares @ spent
    tol = EPS_REL * float(np.abs(base).sum() + 1.0)
    taken = np.zeros(num_jobs, dtype=bool)
    changed = False

    def fits(moves: list[int]) -> bool:
        dg = d_gpus[moves].sum(axis=0)
        if np.any(dg > spare):
            return False
        if len(room_kg):
            return bool(np.all(ctx.shares @ d_kg[moves].sum(axis=0) <= room_kg))
        return True

    def apply(moves: list[int]) -> None:
        nonlocal spare, room_kg, changed
        for m in moves:
            opts[jobs[m]] = rows[m]
            taken[jobs[m]] = True
        spare = spare - d_gpus[moves].sum(axis=0)
        if len(room_kg):
            room_kg = room_kg - ctx.shares @ d_kg[moves].sum(axis=0)
        changed = True

    # Free gains first (a move that needs no GPUs anywhere, or fits the spare ones).
    free = np.flatnonzero((delta < -tol) & np.all(d_gpus <= spare[None, :], axis=1))
    for f in free[np.argsort(delta[free], kind="stable")].tolist():
        if not taken[jobs[f]] and fits([f]):
            apply([f])
    # Then the best buys (gain per GPU), each paid for by the cheapest sells in the slot short
    # of GPUs; a sell re-finishes its job later, which may leave a later slot short: that one
    # is paid for by its own cheapest sells, and so on (a chain forward in time).
    # Where each candidate adds GPUs: a sell's re-finish raises at most 3 slots (others are
    # checked in full by `fits`).
    ups = d_gpus > 0
    few_ups = ups.sum(axis=1) <= 3
    up_slots = np.argsort(~ups, axis=1, kind="stable")[:, :3]
    up_gpus = np.where(
        np.take_along_axis(ups, up_slots, axis=1), np.take_along_axis(d_gpus, up_slots, axis=1), 0
    )
    sells_at = []
    for t in range(num_slots):
        s_t = np.flatnonzero((slot == t) & (d_gpus[:, t] < 0))
        sells_at.append(s_t[np.argsort(delta[s_t] / -d_gpus[s_t, t], kind="stable")])
    buy_slot_gpus = d_gpus[np.arange(len(jobs)), slot]
    buys = np.flatnonzero((buy_slot_gpus > 0) & (delta < -tol))
    buys = buys[np.argsort(delta[buys] / buy_slot_gpus[buys], kind="stable")]
    for b in buys[:MAX_BUYS_PER_PASS].tolist():
        if taken[jobs[b]]:
            continue
        group = [b]
        members = {int(jobs[b])}
        net = d_gpus[b].copy()
        gain = float(delta[b])
        for _ in range(MAX_CHAIN):
            short = np.flatnonzero(net > spare)
            if len(short) == 0 or gain >= -tol:
                break
            u = int(short[0])
            pool = sells_at[u]
            pool = pool[~taken[jobs[pool]] & ~np.isin(jobs[pool], list(members))]
            if len(pool) == 0:
                break
            # Sells that leave no other slot short (checked on the few slots where a sell adds
            # GPUs); one that covers the whole shortfall alone if there is one (the least
            # costly), else the cheapest per GPU, clean ones first.
            ps, pa = up_slots[pool], up_gpus[pool]
            clean = few_ups[pool] & np.all(
                (net[ps] + pa <= spare[ps]) | (ps == u) | (pa == 0), axis=1
            )
            covers = clean & (net[u] + d_gpus[pool, u] <= spare[u])
            if covers.any():
                pick = [int(pool[np.flatnonzero(covers)[np.argmin(delta[pool[covers]])]])]
            else:
                pick = []
                left = int(net[u] - spare[u])
                picked_jobs: set[int] = set()
                for m in (pool[clean].tolist() + pool[~clean].tolist())[:SELL_POOL]:
                    if left <= 0 or gain + float(delta[m]) >= -tol:
                        break
                    # One row per job: the pool holds several sells of one job (other kinds,
                    # other slots), and applying two would count both GPU deltas but keep
                    # only the last row, over-filling a slot.
                    if int(jobs[m]) in picked_jobs:
                        continue
                    picked_jobs.add(int(jobs[m]))
                    pick.append(m)
                    left += int(d_gpus[m, u])
            for m in pick:
                group.append(m)
                members.add(int(jobs[m]))
                net += d_gpus[m]
                gain += float(delta[m])
            if net[u] > spare[u]:
                break
        if gain < -tol and fits(group):
            apply(group)
    return changed
