"""A Lagrangian lower bound on the average JCT under a budget, with exact completion times.

`avg_jct_lower_bound` (bounds.py) prices a job's JCT by its undone work (int (1 - f)) plus
floors on int f; leaving a sliver of a job to a later day then costs only the sliver times the
delay. Here the capacity rows (per slot) and the budget rows (per window) of the same LP are
moved into the objective with prices mu_s, lam_w >= 0, and what is left splits per job into
  min over C >= r, x of  (C - r) + sum_(s, c) x[s, c] cost[s, c]
    x[s, c] >= 0, sum_c x[s, c] <= the part of slot s inside [r, C],
    sum_(s, c) x[s, c] rate_c len_s / work >= 1,
    cost[s, c] = mu_s c + (sum of lam_w over the windows holding s) P_c kg_per_w(s),
the job's exact completion time C instead of the fluid terms. Any replay within the budget
gives, per job, such (C, x) (its time shares per slot and count, as in the LP: stalls only
lower the progress), and its capacity and budget use satisfy the relaxed rows, so for ANY prices
  sum_j JCT_j >= sum_j (job j's minimum above) - sum_s mu_s capacity - sum_w lam_w kg_w
(weak duality). A replay finishing a job after the horizon H gives it a value >= H - r (prices
and costs are >= 0), so that job's minimum is taken with H - r as one more candidate.

Job minimum: for fixed C, the least cost to do the work by C is a fractional knapsack over the
slots (each slot's cost-for-progress curve is the lower convex hull of its counts and (0, 0),
scaled by the slot's available part), Phi(C), nonincreasing in C. For C in [t0, t1],
C - r + Phi(C) >= t0 - r + Phi(t1); the minimum is taken over such pieces (slot ends first,
slots that could still hold the minimum on a grid of at most `fine_s`), so it is a lower bound
on the exact minimum whatever the grid.

Prices start from the LP's duals. Then (columns=True, the default) column generation: a master
LP picks, per job, a convex combination of the schedules the job minima returned so far (plus
one finishing past the horizon at H - r and using nothing, so it is always feasible) within the
capacity and budget rows; its duals are the next prices. The master's value is not a bound (it
converges to this Lagrangian dual's optimum from above); the answer is the best Lagrangian value
seen, each one a bound by weak duality. (columns=False: projected subgradient steps instead,
slower to converge.) The master's value minus the answer is at most about `fine_s` per job, the
finish-time grid's loss.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from bench.bounds.fluid import (
    SEGMENTS,
    BoundError,
    all_job_limits,
    build_lp,
)
from energy_model.carbon.series import IntensitySeries
from energy_model.profiles import ScalingProfile
from scheduler_service.simulate.engine import CarbonClock, SimulationConfig, run_budget_periods
from scheduler_service.simulate.trace import JobTables, TraceJob, job_tables


@dataclass(frozen=True)
class LagrangianBound:
    avg_jct_s: float  # best Lagrangian value / jobs (a bound)
    lp_avg_jct_s: float  # the fluid LP's primal optimum on the same slots, for comparison
    first_avg_jct_s: float  # the value at the LP's duals
    master_avg_jct_s: float  # column generation: the last master LP's value (not a bound)
    iterations: int
    solve_s: float
    history: list[float]


@dataclass
class _Job:
    release: float
    begin: np.ndarray  # the job's slots (from the one holding its release)
    end: np.ndarray
    slot: np.ndarray  # global slot index per job slot
    gains: np.ndarray  # (slots, counts) work fraction per unit x
    gpus: np.ndarray  # (counts,)
    power: np.ndarray  # (counts,)


def _job(job: TraceJob, table: JobTables, edges: np.ndarray) -> _Job:
    first = max(0, int(np.searchsorted(edges, job.submission_s, side="right")) - 1)
    begin, end = edges[first:-1], edges[first + 1 :]
    rates = np.asarray(table.throughput_samples_per_s, dtype=float)
    gains = (end - begin)[:, None] * rates[None, :] / job.total_samples
    return _Job(
        job.submission_s,
        begin,
        end,
        np.arange(first, len(edges) - 1),
        gains,
        np.asarray(table.allowed_gpus, dtype=float),
        np.asarray(table.power_w, dtype=float),
    )


def _increments(
    jb: _Job, mu: np.ndarray, lam_slot: np.ndarray, kg_per_w: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Per slot, the lower convex hull of (gain, cost) over {idle} and the counts, as increments
    (slot, d_gain, d_cost, d_gpus, d_kg) per unit of the slot's available part, sorted by cost
    per gain."""
    mu_s = mu[jb.slot]
    kgw = lam_slot[jb.slot] * kg_per_w[jb.slot]
    cost = mu_s[:, None] * jb.gpus[None, :] + kgw[:, None] * jb.power[None, :]
    kg = kg_per_w[jb.slot][:, None] * jb.power[None, :]
    out_slot, out_g, out_c, out_gpu, out_kg = [], [], [], [], []
    order = np.argsort(jb.gains[0])
    for i in range(len(jb.slot)):
        g = jb.gains[i, order]
        c = cost[i, order]
        hull = [(0.0, 0.0, 0.0, 0.0)]  # gain, cost, gpus, kg
        for k, col in enumerate(order):
            point = (float(g[k]), float(c[k]), float(jb.gpus[col]), float(kg[i, col]))
            if point[0] <= hull[-1][0]:
                if point[1] < hull[-1][1] and point[0] == hull[-1][0]:
                    hull[-1] = point
                continue
            while len(hull) >= 2:
                (g1, c1, *_), (g2, c2, *_) = hull[-2], hull[-1]
                # Drop the last point if it lies on or above the chord to the new one.
                if (c2 - c1) * (point[0] - g1) >= (point[1] - c1) * (g2 - g1):
                    hull.pop()
                else:
                    break
            hull.append(point)
        for a, b in itertools.pairwise(hull):
            out_slot.append(i)
            out_g.append(b[0] - a[0])
            out_c.append(b[1] - a[1])
            out_gpu.append(b[2] - a[2])
            out_kg.append(b[3] - a[3])
    slot = np.array(out_slot, dtype=int)
    dg = np.array(out_g)
    dc = np.array(out_c)  # >= 0: hull slopes rise from the first, c / g >= 0
    ratio = dc / dg
    idx = np.argsort(ratio, kind="stable")
    return slot[idx], dg[idx], dc[idx], np.array(out_gpu)[idx], np.array(out_kg)[idx], ratio[idx]


def _phi(jb: _Job, inc: tuple[np.ndarray, ...], times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least cost to finish by each of `times` (inf: cannot) and, per time, the fraction of each
    increment taken (rows)."""
    slot, dg, dc, _, _, ratio = inc
    a = np.maximum(jb.begin, jb.release)
    length = jb.end - jb.begin
    factor = np.clip((np.minimum(times[:, None], jb.end[None, :]) - a[None, :]) / length, 0.0, 1.0)
    f_inc = factor[:, slot]  # (T, n)
    g = dg[None, :] * f_inc
    cum = np.cumsum(g, axis=1)
    total = cum[:, -1] if cum.shape[1] else np.zeros(len(times))
    # Increments taken fully: cum <= 1; the first crossing one partly.
    before = cum - g
    take = np.clip((1.0 - before) / np.where(g > 0, g, 1.0), 0.0, 1.0) * (g > 0)
    cost = (take * f_inc * dc[None, :]).sum(axis=1)
    cost = np.where(total >= 1.0 - 1e-12, cost, np.inf)
    del ratio
    return cost, take * f_inc


def _job_min(
    jb: _Job, inc: tuple[np.ndarray, ...], horizon_s: float, fine_s: float
) -> tuple[float, float, np.ndarray | None]:
    """(lower bound on min_C C - r + Phi(C), best C found, its increment takes)."""
    r = jb.release
    ends = jb.end
    bound = horizon_s - r  # finishing past the horizon
    best_val = math.inf
    best_take: np.ndarray | None = None
    best_c = horizon_s
    chunk = 64
    values_end: list[float] = []
    starts = np.maximum(jb.begin, r)
    n = len(ends)
    # No C before the earliest finish at the top rate is feasible (Phi = inf there), so each
    # piece's left end is raised to it.
    top = jb.gains.max(axis=1) / (jb.end - jb.begin)  # work fraction per second, per slot
    done_before = np.concatenate([[0.0], np.cumsum(top * (ends - starts))])
    cross = int(np.searchsorted(done_before, 1.0, side="left"))
    earliest = (
        math.inf
        if cross > n
        else float(starts[cross - 1] + (1.0 - done_before[cross - 1]) / top[cross - 1])
    )
    i = 0
    while i < n:
        if starts[i] - r >= min(best_val, bound):
            bound = min(bound, starts[i] - r)
            break
        phi, take = _phi(jb, inc, ends[i : i + chunk])
        for k in range(len(phi)):
            v = ends[i + k] - r + phi[k]
            values_end.append(float(phi[k]))
            if v < best_val:
                best_val, best_take, best_c = float(v), take[k], float(ends[i + k])
        i += chunk
    # Per slot: C in [start, end] gives >= start - r + Phi(end); refine where that can win.
    for k, phi_end in enumerate(values_end):
        crude = max(starts[k], earliest) - r + phi_end
        if crude >= best_val:
            bound = min(bound, crude)
            continue
        pieces = max(1, math.ceil((ends[k] - starts[k]) / fine_s))
        grid = np.linspace(starts[k], ends[k], pieces + 1)
        phi, take = _phi(jb, inc, grid)
        vals = grid - r + phi
        j = int(np.argmin(vals))
        if vals[j] < best_val:
            best_val, best_take, best_c = float(vals[j]), take[j], float(grid[j])
        bound = min(bound, float((np.maximum(grid[:-1], earliest) - r + phi[1:]).min()))
    return min(bound, best_val), best_c, best_take


def avg_jct_lagrangian_bound(
    jobs: list[TraceJob],
    series: IntensitySeries,
    profiles: dict[str, ScalingProfile],
    config: SimulationConfig,
    *,
    horizon_s: float,
    iterations: int = 30,
    fine_s: float = 60.0,
    time_limit_s: float = 1800.0,
    step: float = 1.0,
    columns: bool = True,
    log: bool = False,
) -> LagrangianBound:
    """Lagrangian bound of the module docstring (horizon_s: trace seconds, any is valid)."""
    began = time.perf_counter()
    start_s, _, periods = run_budget_periods(config, jobs)
    tables = [job_tables(j, profiles, config.capacity_gpus) for j in jobs]
    clock = CarbonClock(series, config.pue)
    last_release = max(j.submission_s for j in jobs)
    until_s = last_release + 4 * (horizon_s - start_s)
    limits = all_job_limits(jobs, tables, clock, config, periods, start_s, until_s)
    model = build_lp(
        jobs, tables, clock, config, periods, start_s, horizon_s, SEGMENTS, limits, until_s
    )
    res = model.solve()
    if res.status != 0:
        raise BoundError(f"LP ended with status {res.status}: {res.message}")
    marg = -np.asarray(res.ineqlin.marginals)
    mu = np.maximum(marg[model.capacity_rows], 0.0)
    lam = np.array([max(marg[row], 0.0) for row, *_ in model.budget_rows])
    edges = model.edges
    begin, end = edges[:-1], edges[1:]
    windows = [(w_from, w_to, kg) for _, w_from, w_to, kg in model.budget_rows]
    member = np.zeros((len(windows), len(begin)), dtype=bool)
    for w, (w_from, w_to, _) in enumerate(windows):
        member[w] = (begin >= w_from - 1e-6) & (end <= w_to + 1e-6)
    kg_w = np.array([kg for *_, kg in windows])
    cap = float(config.capacity_gpus)
    jbs = [_job(job, table, edges) for job, table in zip(jobs, tables, strict=True)]
    history: list[float] = []
    best = -math.inf
    first_value = math.nan
    since = 0
    n_slots, n_win = len(begin), len(windows)
    # Column generation (columns=True): a master LP over the job schedules found so far (each
    # job a convex combination; one column per job finishes past the horizon at H - r using
    # nothing, so the master is always feasible); its duals are the next prices.
    col_job: list[int] = []
    col_value: list[float] = []
    col_rows: list[np.ndarray] = []
    col_vals: list[np.ndarray] = []
    if columns:
        for j, jb in enumerate(jbs):
            col_job.append(j)
            col_value.append(horizon_s - jb.release)
            col_rows.append(np.zeros(0, dtype=int))
            col_vals.append(np.zeros(0))
    master_value = math.nan
    last_master = math.inf
    stalled = 0
    for it in range(iterations):
        lam_slot = member.T.astype(float) @ lam if len(lam) else np.zeros(n_slots)
        total = -float(mu.sum() * cap) - float(lam @ kg_w)
        gpu_use = np.zeros(n_slots)
        kg_use = np.zeros(n_slots)
        for j, jb in enumerate(jbs):
            inc = _increments(jb, mu, lam_slot, model.kg_per_w)
            value, best_c, take = _job_min(jb, inc, horizon_s, fine_s)
            total += value
            if take is not None:
                slot, _, _, d_gpu, d_kg, _ = inc
                g = np.zeros(n_slots)
                k = np.zeros(n_slots)
                np.add.at(g, jb.slot[slot], take * d_gpu)
                np.add.at(k, jb.slot[slot], take * d_kg)
                gpu_use += g
                kg_use += k
                if columns:
                    used = np.nonzero(g)[0]
                    per_window = member.astype(float) @ k
                    wins = np.nonzero(per_window)[0]
                    col_job.append(j)
                    col_value.append(best_c - jb.release)
                    col_rows.append(np.concatenate([used, n_slots + wins]))
                    col_vals.append(np.concatenate([g[used], per_window[wins]]))
        history.append(total / len(jobs))
        if it == 0:
            first_value = total / len(jobs)
        if not math.isfinite(best) or total > best + 1e-9 * abs(best):
            best, since = total, 0
        else:
            since += 1
            if since >= 3 and not columns:
                step, since = step / 2, 0
        if log:
            print(
                f"iter {it}: {total / len(jobs):.1f} (best {best / len(jobs):.1f}) "
                f"master {master_value / len(jobs):.1f} step {step}"
            )
        if time.perf_counter() - began > time_limit_s:
            break
        if columns:
            n_col = len(col_job)
            rows = np.concatenate(col_rows)
            cols = np.concatenate([np.full(len(r), i) for i, r in enumerate(col_rows)])
            a_m = sp.csr_array(
                (np.concatenate(col_vals), (rows, cols)), shape=(n_slots + n_win, n_col)
            )
            b_m = np.concatenate([np.full(n_slots, cap), kg_w])
            a_conv = sp.csr_array(
                (np.ones(n_col), (np.array(col_job), np.arange(n_col))), shape=(len(jbs), n_col)
            )
            master = linprog(
                np.array(col_value),
                A_ub=a_m,
                b_ub=b_m,
                A_eq=a_conv,
                b_eq=np.ones(len(jbs)),
                bounds=(0, None),
                method="highs",
            )
            if master.status != 0:
                raise BoundError(f"master LP ended with status {master.status}")
            master_value = float(master.fun)
            duals = np.maximum(-np.asarray(master.ineqlin.marginals), 0.0)
            mu, lam = duals[:n_slots], duals[n_slots:]
            # Stop when the gap closes or the master has stopped moving for 10 rounds.
            if master.fun < last_master - 1e-7 * abs(master.fun):
                last_master, stalled = float(master.fun), 0
            else:
                stalled += 1
            if master_value - best <= 1e-4 * master_value or stalled >= 10:
                break
            continue
        # Projected subgradient in scaled units (rows divided by their right-hand sides).
        g_cap = (gpu_use - cap) / cap
        g_kg = (member.astype(float) @ kg_use - kg_w) / kg_w
        norm = float(g_cap @ g_cap + g_kg @ g_kg)
        if norm <= 0:
            break
        target = max(best, total) * 0.05 + 1.0
        t = step * target / norm
        mu = np.maximum(0.0, mu + t * g_cap / cap)
        lam = np.maximum(0.0, lam + t * g_kg / kg_w)
    return LagrangianBound(
        avg_jct_s=best / len(jobs),
        lp_avg_jct_s=float(res.fun) / len(jobs),
        first_avg_jct_s=first_value,
        master_avg_jct_s=master_value / len(jobs),
        iterations=len(history),
        solve_s=time.perf_counter() - began,
        history=history,
    )
