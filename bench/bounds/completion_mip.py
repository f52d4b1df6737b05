"""A tighter average-JCT lower bound than the fluid LP: the LP plus completion integrality for
chosen jobs, solved as a MIP (HiGHS through scipy); its dual bound is valid when stopped early.

Kept for the record: on the 100-job bench HiGHS reached 17,920 s in 600 s against the Lagrangian
bound's 19,782 s (docs/allocation.md, "Lower bounds"), so `bench/bounds/lagrangian.py` is the
one `bench/schedule_quality.py` uses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from bench.bounds.fluid import SEGMENTS, BoundError, all_job_limits, build_lp
from energy_model.carbon.series import IntensitySeries
from energy_model.profiles import ScalingProfile
from scheduler_service.simulate.engine import CarbonClock, SimulationConfig, run_budget_periods
from scheduler_service.simulate.trace import TraceJob, job_tables


@dataclass(frozen=True)
class MipJctBound:
    """`avg_jct_lower_bound_mip`'s answer: the MIP's best bound, whether or not it closed."""

    avg_jct_s: float  # the bound: min(MIP dual bound, until_s - last release) / jobs
    lp_avg_jct_s: float  # the plain LP's bound on the same slots (avg_jct_lower_bound's terms)
    incumbent_avg_jct_s: float | None  # the best MIP solution found (not a bound), if any
    closed: bool  # the MIP was solved to its gap (else stopped at the time limit)
    mip_gap: float | None
    nodes: int | None
    binary_jobs: int
    binaries: int
    variables: int
    horizon_s: float
    segment_s: float
    solve_s: float


def avg_jct_lower_bound_mip(
    jobs: list[TraceJob],
    series: IntensitySeries,
    profiles: dict[str, ScalingProfile],
    config: SimulationConfig,
    *,
    binary_jobs: Collection[str] | None = None,
    segment_s: float = 6 * 3600.0,
    horizon_s: float,
    time_limit_s: float = 600.0,
    job_span_s: float | None = None,
    full_horizon_jobs: Collection[str] | None = None,
    segments: int = SEGMENTS,
    display: bool = False,
) -> MipJctBound:
    """The LP of `avg_jct_lower_bound` plus completion integrality for `binary_jobs` (None:
    all), solved as a MIP; the answer is the MIP's dual (best) bound, valid when stopped early.
    `job_span_s`: the slots of jobs not in `full_horizon_jobs` end that long after their release
    (build_lp's job_ends; a binary job's last segment then ends there, and not being done by
    then costs it that span, which its JCT then exceeds).

    Segment ends T_k are start_s + k * segment_s (and the horizon); slots are also cut there.
    For a job j with binaries, per segment k of [r, H] (length L_k after r):
    - F_k = the work fraction done by T_k (the sum of the LP's per-slot progress);
    - z_k binary, z_k <= F_k, z_k <= z_(k+1): in a replay z_k = [C <= T_k] satisfies both (a job
      done by T_k has F_k = 1), and z_k = 0 where T_k is before its earliest finish;
    - JCT >= sum_k L_k (1 - z_k): with z the true indicator the sum is T_(k*-1) - r <= C - r,
      k* the segment the job finishes in (H - r when it finishes past H);
    - JCT >= (the LP's undone-work term) + sum_k W_k, W_k >= 0,
      W_k >= L_k F_(k-1) + sum_(s in k) y_s (the time left in k after slot s) - L_k z_k:
      C - r = int_r^C (1 - f) + int_r^C f; the first is at least the undone-work term (module
      docstring); for each segment k entirely before C (z_k = 0), int over k of f is at least
      sum over its slots s of (slot time after r) * (f at the slot's start) = the expression
      with z_k = 0; where z_k = 1 the expression is <= 0 (F <= 1), so W_k = max(0, expr) is
      at most int over k of f, and the segments before C are disjoint parts of [r, C).
    Every replay within the budget finishing every job by until_s therefore maps to a feasible
    point of the MIP with objective <= its JCT sum, as for the LP; later finishes are covered by
    min(., until_s - last release) as in `avg_jct_lower_bound`. The MIP's dual bound comes from
    HiGHS (primal feasibility tolerances apply: unlike the LP it is not re-derived from duals).
    """
    start_s, _, periods = run_budget_periods(config, jobs)
    tables = [job_tables(j, profiles, config.capacity_gpus) for j in jobs]
    clock = CarbonClock(series, config.pue)
    began = time.perf_counter()
    last_release = max(j.submission_s for j in jobs)
    until_s = last_release + 4 * (horizon_s - start_s)
    limits = all_job_limits(jobs, tables, clock, config, periods, start_s, until_s)
    count = math.ceil((horizon_s - start_s) / segment_s)
    grid = np.array([start_s + k * segment_s for k in range(1, count)] + [horizon_s])
    # Jobs without binaries get their own horizon (their tail past it costs its distance from
    # the release and uses nothing: a relaxation, see build_lp), to keep the model small.
    job_ends = [
        horizon_s
        if job_span_s is None or (full_horizon_jobs is not None and job.job_id in full_horizon_jobs)
        else min(horizon_s, job.submission_s + job_span_s)
        for job in jobs
    ]
    model = build_lp(
        jobs,
        tables,
        clock,
        config,
        periods,
        start_s,
        horizon_s,
        segments,
        limits,
        until_s,
        np.concatenate([grid, job_ends]),
        job_ends,
    )
    edges = model.edges
    begin, end = edges[:-1], edges[1:]
    n_var = len(model.c)
    extra_lb: list[float] = []
    extra_ub: list[float] = []
    extra_int: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    row_lb: list[float] = []
    row_ub: list[float] = []

    def new_var(lo: float, hi: float, integer: bool = False) -> int:
        nonlocal n_var
        extra_lb.append(lo)
        extra_ub.append(hi)
        extra_int.append(1 if integer else 0)
        n_var += 1
        return n_var - 1

    def add_row(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(row_lb)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        row_lb.append(lo)
        row_ub.append(hi)

    chosen = 0
    binaries = 0
    for job, limit, jc in zip(jobs, limits, model.jobs, strict=True):
        if binary_jobs is not None and job.job_id not in binary_jobs:
            continue
        chosen += 1
        release = job.submission_s
        earliest = release + limit.earliest_jct_s
        job_end = float(edges[jc.end_slot])
        seg_ends = [float(t) for t in grid if release < t < job_end - 1e-3] + [job_end]
        seg_starts = [release, *seg_ends[:-1]]
        slot_ids = np.arange(jc.first_slot, jc.end_slot)
        after = np.maximum(begin[slot_ids], release)
        slot_time = np.maximum(end[slot_ids] - after, 0.0)
        f_prev: int | None = None
        z_prev: int | None = None
        completion: list[tuple[int, float]] = []
        total_len = 0.0
        w_cols: list[int] = []
        for seg_from, seg_to in zip(seg_starts, seg_ends, strict=True):
            length = seg_to - seg_from
            inside = np.nonzero(
                (end[slot_ids] > seg_from + 1e-6) & (end[slot_ids] <= seg_to + 1e-6)
            )[0]
            f_col = new_var(0.0, 1.0)
            z_col = new_var(0.0, 0.0 if seg_to < earliest - 1e-6 else 1.0, integer=True)
            w_col = new_var(0.0, length)
            binaries += 1
            # F_k = F_(k-1) + progress in the segment's slots.
            entries = [(f_col, 1.0)] + ([(f_prev, -1.0)] if f_prev is not None else [])
            # Time in the segment after each slot (for f at the slot's start, weighted).
            times = slot_time[inside]
            later = np.concatenate([np.cumsum(times[::-1])[::-1][1:], [0.0]])
            w_entries: list[tuple[int, float]] = [(w_col, -1.0), (z_col, -length)]
            if f_prev is not None:
                w_entries.append((f_prev, length))
            for i, t_after in zip(inside, later, strict=True):
                for col in jc.progress[i]:
                    entries.append((int(col), -1.0))
                    if t_after > 0:
                        w_entries.append((int(col), float(t_after)))
            add_row(entries, 0.0, 0.0)
            add_row([(z_col, 1.0), (f_col, -1.0)], -np.inf, 0.0)
            if z_prev is not None:
                add_row([(z_prev, 1.0), (z_col, -1.0)], -np.inf, 0.0)
            add_row(w_entries, -np.inf, 0.0)
            completion.append((z_col, -length))
            total_len += length
            w_cols.append(w_col)
            f_prev, z_prev = f_col, z_col
        add_row([(jc.jct, -1.0), *completion], -np.inf, -total_len)
        undone = [(int(c), float(v)) for c, v in zip(jc.undone_cols, jc.undone_vals, strict=True)]
        add_row([(jc.jct, -1.0), *undone, *((w, 1.0) for w in w_cols)], -np.inf, 0.0)
    n_extra = len(extra_lb)
    base_vars = len(model.c)
    c_vec = np.concatenate([model.c, np.zeros(n_extra)])
    a_ub = sp.hstack([model.a_ub, sp.csr_array((model.a_ub.shape[0], n_extra))])
    a_eq = sp.hstack([model.a_eq, sp.csr_array((model.a_eq.shape[0], n_extra))])
    a_new = sp.csr_array((vals, (rows, cols)), shape=(len(row_lb), n_var))
    constraints = [
        LinearConstraint(a_ub, -np.inf, model.b_ub),
        LinearConstraint(a_eq, model.b_eq, model.b_eq),
        LinearConstraint(a_new, np.array(row_lb), np.array(row_ub)),
    ]
    integrality = np.concatenate([np.zeros(base_vars), np.array(extra_int)])
    bounds = Bounds(
        np.concatenate([model.lb, np.array(extra_lb)]),
        np.concatenate([model.ub, np.array(extra_ub)]),
    )
    lp = model.solve()
    res = milp(
        c_vec,
        constraints=constraints,
        integrality=integrality,
        bounds=bounds,
        options={"time_limit": time_limit_s, "disp": display},
    )
    dual = getattr(res, "mip_dual_bound", None)
    if dual is None or not math.isfinite(dual):
        raise BoundError(f"JCT bound MIP gave no dual bound (status {res.status}: {res.message})")
    n = len(jobs)
    return MipJctBound(
        avg_jct_s=float(min(dual, until_s - last_release) / n),
        lp_avg_jct_s=float(lp.fun / n) if lp.status == 0 else math.nan,
        incumbent_avg_jct_s=float(res.fun / n) if res.x is not None else None,
        closed=res.status == 0,
        mip_gap=getattr(res, "mip_gap", None),
        nodes=getattr(res, "mip_node_count", None),
        binary_jobs=chosen,
        binaries=binaries,
        variables=n_var,
        horizon_s=horizon_s,
        segment_s=segment_s,
        solve_s=time.perf_counter() - began,
    )
