"""A lower bound on the average JCT that ANY scheduler can reach in the simulator (fluid LP).

Used by bench/schedule_quality.py to tell a missed JCT target from an unreachable one: under a
per-day carbon budget no policy's average JCT can beat `avg_jct_lower_bound`, so
capped carbon-agnostic's average JCT / the bound caps the speed-up any policy could show.

The relaxation, checked against `engine.simulate_trace`'s semantics:

Slots. The time from the first submission to a horizon end H is cut at every step of the
(wrapping) intensity series and at the budget windows' edges (below), so each slot has one
intensity: running power P for any x-fraction of slot s emits exactly P * x * kg_per_w(s).

Variables. x[j, c, s] >= 0: fraction of slot s that job j runs at allowed count c (switch stalls
included: the simulator draws full power through them); y[j, s]: fraction of j's work done in s;
tail[j]: fraction done after H. A replayed schedule maps to a feasible point:
- sum_c x[j, c, s] <= the part of s after j's submission (a job runs at one count at a time
  and only once it joined, which the engine does at or after its submission);
- y[j, s] <= sum_c rate_c x[j, c, s] len_s / work_j (stalls make no progress: real <= nominal);
  sum_s y[j, s] + tail[j] = 1; nothing constrains the tail, so every schedule fits, however long;
- sum_{j,c} c x[j, c, s] <= capacity (the slot's time average of an instantaneous limit);
- budget: the engine charges each applied interval's kg to the periods it overlaps in
  proportion to time (not intensity), and an interval is at most one slot_s long. So period
  i's charge is at least the exact emissions inside [B_i + slot_s, E_i - slot_s) (every interval
  touching that window lies inside the period), and periods i and i+1 together at least those
  inside [B_i + slot_s, E_{i+1} - slot_s). Both are constrained to the share(s) (the first
  period needs no left margin: nothing runs before it). A policy that overspends its budget
  (report.budget_violations > 0) is outside the bound.

Objective, per job (release r, finish C, work fraction done f(t), p = work / max rate):
JCT = C - r = int_r^C (1 - f) + int_r^C f.
- int_r^C f >= p / 2: f rises at most 1/p per second, so f(t) >= 1 - (C - t) / p.
- int_r^inf (1 - f) over slot s (a = max(start_s, r), F_s = f at the slot's end) is at least
  (end_s - a)(1 - F_s) + p y_s^2 / 2: the y_s done in s take at least p y_s seconds, and
  1 - f is smallest when they are done at full speed from a. Summed over slots,
  sum_s (end_s - a)(1 - F_s) = sum_s y_s (a_s - r) + tail (H - r).
- p y^2 / 2 is convex: it is bounded from below by the maximum of its tangents at
  0, u/(M-1), ..., u (u = the most of the work the slot can hold), written as M segments of y
  with those slopes (the LP fills the cheap ones first). Exact where a slot is used fully.
Per-job floors (`job_limits`, computed before the LP from the job alone). Each period's own
window [B_i + slot_s, E_i - slot_s) caps the job's progress inside it at Q: the most work the
job alone can do there emitting at most the period's share (an upper bound from the Lagrangian of
that small LP, any price); between windows only its top rate 1/p limits it. Then
- C >= E, the earliest time those caps let the work be done (each window's Q as early as
  its top rate allows);
- int_r^C f >= D(C): f(t) >= 1 - (the most progress possible in (t, C]), reached by packing
  each window's Q at its end at the top rate. D is minimised over C in [E, U] on a grid: for C
  in [C0, C1], D(C) >= D(C1) - (C1 - C0) (f <= 1), intervals split while that floor can beat
  the best value, to within 10 s. D >= p / 2 always (a single run at the top rate).
These hold for schedules that finish the job by U. A schedule finishing some job after U has a
JCT sum above U - (last release), so the answer is min(LP bound, U - last release) and U is
raised until the LP bound is below U - last release.
The LP takes them through one variable per job: jct_j >= (its undone-work term above) + D_j and
jct_j >= E_j - r_j, minimising sum_j jct_j.
So sum_j JCT_j >= LP optimum (never below the undone-work LP plus sum_j p_j / 2). For one job
alone with no budget and its fastest count within capacity, this is exactly its run time at that count when it ends at a
slot edge (and within p u^2 / (8 (M-1)^2) of it otherwise). Tail work (past H) costs H - r,
so the bound is valid for any H; H is extended until the tail is unused, which only tightens it.

The answer is not the LP's primal value but a Lagrangian dual value from HiGHS's duals (every
variable is boxed), a bound by weak duality whatever the solver's tolerances were.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from energy_model.carbon.series import IntensitySeries
from energy_model.profiles import ScalingProfile
from scheduler_service.allocation.snapshot import BudgetWindow
from scheduler_service.simulate.engine import (
    PERIOD_S,
    CarbonClock,
    SimulationConfig,
    _extend_periods,
    run_budget_periods,
)
from scheduler_service.simulate.trace import JobTables, TraceJob, job_tables

# Tangent points of the p y^2 / 2 term per job-slot (M above).
SEGMENTS = 4
# Work fraction left past the horizon below which the horizon counts as long enough.
TAIL_TOLERANCE = 1e-7
# (from_s, to_s, cap): the most work fraction a job alone can do in [from_s, to_s).
Stretch = tuple[float, float, float]
# A job's done-work floor is searched over its finish time to within this many seconds.
FINE_S = 10.0
# Evaluations of one job's done-work floor before the search keeps its coarse intervals' floors.
MAX_EVALUATIONS = 20_000


class BoundError(RuntimeError):
    """The LP could not be solved (the message says how it ended)."""


@dataclass(frozen=True)
class JctBound:
    """Lower bound on the average JCT of a job set under one simulator configuration."""

    avg_jct_s: float  # the bound (Lagrangian dual value, valid whatever the solver tolerances)
    lp_avg_jct_s: float  # the LP's primal optimum for comparison (>= avg_jct_s up to tolerance)
    jobs: int
    horizon_s: float  # horizon end H in trace seconds
    tail_work: float  # summed work fractions the LP left past H (0: H long enough)
    slots: int
    variables: int
    solve_s: float


def avg_jct_lower_bound(
    jobs: list[TraceJob],
    series: IntensitySeries,
    profiles: dict[str, ScalingProfile],
    config: SimulationConfig,
    *,
    only: Collection[str] | None = None,
    segments: int = SEGMENTS,
    max_rounds: int = 4,
    horizon_s: float | None = None,
) -> JctBound:
    """Lower bound on avg JCT of `jobs` (or the ids in `only`) replayed under `config`.

    `horizon_s`: the first horizon end (trace seconds; None: estimated); it doubles, at most
    `max_rounds - 1` times, while the LP leaves work past it. Any horizon gives a valid bound.
    """
    if not jobs:
        raise ValueError("no jobs")
    # Budget periods exactly as the replay of all of `jobs` sets them (rejected jobs included).
    start_s, _, periods = run_budget_periods(config, jobs)
    chosen = [j for j in jobs if only is None or j.job_id in only]
    if not chosen:
        raise ValueError("no job selected")
    tables = [job_tables(j, profiles, config.capacity_gpus) for j in chosen]
    clock = CarbonClock(series, config.pue)
    if horizon_s is None:
        horizon_s = _first_horizon(chosen, tables, clock, config, periods, start_s)
    began = time.perf_counter()
    last_release = max(j.submission_s for j in chosen)
    # Any schedule finishing a job after until_s has a JCT sum above until_s - last_release, so
    # the per-job floors need only hold for schedules finishing every job by until_s.
    until_s = last_release + 2 * (horizon_s - start_s)
    limits = all_job_limits(chosen, tables, clock, config, periods, start_s, until_s)
    result = _solve(
        chosen, tables, clock, config, periods, start_s, horizon_s, segments, limits, until_s
    )
    for _ in range(max_rounds - 1):
        if result.tail_work <= TAIL_TOLERANCE:
            break
        horizon_s = start_s + 2 * (horizon_s - start_s)
        result = _solve(
            chosen, tables, clock, config, periods, start_s, horizon_s, segments, limits, until_s
        )
    for _ in range(max_rounds - 1):
        if result.bound_sum_s <= until_s - last_release:
            break
        until_s = last_release + 2 * result.bound_sum_s
        limits = all_job_limits(chosen, tables, clock, config, periods, start_s, until_s)
        result = _solve(
            chosen, tables, clock, config, periods, start_s, horizon_s, segments, limits, until_s
        )
    bound_sum_s = min(result.bound_sum_s, until_s - last_release)
    return JctBound(
        avg_jct_s=float(bound_sum_s / len(chosen)),
        lp_avg_jct_s=float(result.primal_sum_s / len(chosen)),
        jobs=len(chosen),
        horizon_s=float(horizon_s),
        tail_work=result.tail_work,
        slots=result.slots,
        variables=result.variables,
        solve_s=time.perf_counter() - began,
    )


def _first_horizon(
    jobs: list[TraceJob],
    tables: list[JobTables],
    clock: CarbonClock,
    config: SimulationConfig,
    periods: list[BudgetWindow],
    start_s: float,
) -> float:
    """A horizon end likely long enough (any is valid, see the module docstring): last release
    + least GPU-seconds / capacity + days of least-kg work at the budget's daily rate and the
    series' mean intensity + the longest job at full speed."""
    gpu_s = 0.0
    joules = 0.0
    longest_s = 0.0
    for job, table in zip(jobs, tables, strict=True):
        rates = np.asarray(table.throughput_samples_per_s)
        gpu_s += job.total_samples * float(np.min(np.asarray(table.allowed_gpus) / rates))
        joules += job.total_samples * float(np.min(np.asarray(table.power_w) / rates))
        longest_s = max(longest_s, job.total_samples / float(rates.max()))
    span_s = max(j.submission_s for j in jobs) - start_s
    horizon = span_s + gpu_s / config.capacity_gpus + longest_s
    if periods:
        kg_per_w_s = clock.kg_per_w(0.0, clock.span_s) / clock.span_s
        least_kg = joules * kg_per_w_s
        first, end, share_kg = periods[0].start_s, periods[0].end_s, periods[0].budget_kg
        length_s = end - first if math.isfinite(end) else math.inf
        if math.isfinite(length_s) and share_kg > 0:
            horizon += 1.5 * least_kg / share_kg * length_s + length_s
    return start_s + max(horizon, config.slot_s)


def _periods_until(
    config: SimulationConfig, periods_in_span: list[BudgetWindow], until_s: float
) -> list[BudgetWindow]:
    """The run's budget periods, extended (each further one at the same share) past until_s."""
    periods = list(periods_in_span)
    if periods and config.budget_period in PERIOD_S:
        spent = [0.0] * len(periods)
        _extend_periods(config, periods, spent, periods[0].budget_kg, until_s + PERIOD_S["day"])
    return periods


def all_job_limits(
    jobs: list[TraceJob],
    tables: list[JobTables],
    clock: CarbonClock,
    config: SimulationConfig,
    periods_in_span: list[BudgetWindow],
    start_s: float,
    until_s: float,
) -> list[JobLimits]:
    """Every job's floors under each budget period's own window, periods extended to until_s."""
    periods = _periods_until(config, periods_in_span, until_s)
    windows = _windows(config, periods, start_s, until_s, pairs=False)
    return [
        job_limits(job, table, clock, windows, until_s)
        for job, table in zip(jobs, tables, strict=True)
    ]


@dataclass(frozen=True)
class _Solved:
    bound_sum_s: float
    primal_sum_s: float
    tail_work: float
    slots: int
    variables: int


def _boundaries(
    clock: CarbonClock,
    windows: list[BudgetWindow],
    start_s: float,
    horizon_s: float,
) -> np.ndarray:
    """Slot edges in [start_s, horizon_s]: every step of the wrapping series and window edge."""
    steps = clock.step_offsets_s
    first_wrap = math.floor(start_s / clock.span_s)
    last_wrap = math.floor(horizon_s / clock.span_s)
    marks = [steps + k * clock.span_s for k in range(first_wrap, last_wrap + 1)]
    edges = np.concatenate(
        [
            *marks,
            np.array([start_s, horizon_s]),
            np.array([w.start_s for w in windows]),
            np.array([w.end_s for w in windows]),
        ]
    )
    edges = edges[(edges >= start_s) & (edges <= horizon_s) & np.isfinite(edges)]
    edges = np.unique(edges)
    # Float noise would leave sliver slots: merge edges closer than a millisecond.
    keep = np.concatenate([[True], np.diff(edges) > 1e-3])
    return edges[keep]


def _windows(
    config: SimulationConfig,
    periods: list[BudgetWindow],
    start_s: float,
    horizon_s: float,
    *,
    pairs: bool = True,
) -> list[BudgetWindow]:
    """(from_s, to_s, kg): emissions inside [from_s, to_s) are at most kg (module docstring);
    without `pairs` only each period's own window (disjoint, in time order)."""
    if not periods:
        return []
    if not math.isfinite(periods[0].end_s):
        return [BudgetWindow(start_s, horizon_s, periods[0].budget_kg)]
    margin = config.slot_s
    out = []
    for i, period in enumerate(periods):
        if period.start_s >= horizon_s:
            break
        left = period.start_s + margin if i > 0 else period.start_s
        out.append(BudgetWindow(left, min(period.end_s - margin, horizon_s), period.budget_kg))
        if pairs and i + 1 < len(periods):
            after = periods[i + 1]
            out.append(
                BudgetWindow(
                    left, min(after.end_s - margin, horizon_s), period.budget_kg + after.budget_kg
                )
            )
    return [w for w in out if w.end_s > w.start_s]


@dataclass(frozen=True)
class JobColumns:
    """Where one job sits in the LP (`build_lp`): its slots, progress and JCT columns."""

    first_slot: int  # index of the job's first slot (the one holding its release)
    end_slot: int  # one past its last slot (its own horizon: work after goes to the tail)
    progress: np.ndarray  # (slots from first_slot, M) columns; row sums: work fraction per slot
    tail: int  # work fraction done past the horizon
    jct: int  # the job's JCT variable (seconds)
    undone_cols: np.ndarray  # the undone-work term: sum undone_vals * x[undone_cols] <= ...
    undone_vals: np.ndarray  # ... int_r^inf (1 - f) dt of any schedule (module docstring)


@dataclass(frozen=True)
class LpModel:
    """The LP of the module docstring: minimise c x, A_ub x <= b_ub, A_eq x = b_eq, lb..ub."""

    c: np.ndarray
    a_ub: sp.csr_array
    b_ub: np.ndarray
    a_eq: sp.csr_array
    b_eq: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    edges: np.ndarray  # slot edges (trace seconds)
    jobs: list[JobColumns]
    kg_per_w: np.ndarray  # per slot: kg per W drawn through the whole slot
    capacity_rows: np.ndarray  # per slot: its capacity row in a_ub
    budget_rows: list[tuple[int, float, float, float]]  # (row, from_s, to_s, kg) per window

    def solve(self) -> Any:
        """The LP solved by HiGHS (scipy's OptimizeResult; check its status)."""
        return linprog(
            self.c,
            A_ub=self.a_ub,
            b_ub=self.b_ub,
            A_eq=self.a_eq,
            b_eq=self.b_eq,
            bounds=np.column_stack([self.lb, self.ub]),
            method="highs",
        )


def _solve(
    jobs: list[TraceJob],
    tables: list[JobTables],
    clock: CarbonClock,
    config: SimulationConfig,
    periods_in_span: list[BudgetWindow],
    start_s: float,
    horizon_s: float,
    segments: int,
    limits: list[JobLimits],
    until_s: float,
) -> _Solved:
    """Build and solve the LP of the module docstring over [start_s, horizon_s)."""
    model = build_lp(
        jobs, tables, clock, config, periods_in_span, start_s, horizon_s, segments, limits, until_s
    )
    c_vec, a_ub, b_vec, a_eq, b_eq = model.c, model.a_ub, model.b_ub, model.a_eq, model.b_eq
    lb, ub = model.lb, model.ub
    res = model.solve()
    if res.status != 0:
        raise BoundError(f"JCT bound LP ended with status {res.status}: {res.message}")
    # Weak duality with any multipliers (y_ub <= 0 as scipy signs them): a bound for sure.
    y_ub = np.minimum(np.asarray(res.ineqlin.marginals), 0.0)
    y_eq = np.asarray(res.eqlin.marginals)
    reduced = c_vec - a_ub.T @ y_ub - a_eq.T @ y_eq
    dual = float(np.minimum(reduced * lb, reduced * ub).sum() + y_ub @ b_vec + y_eq @ b_eq)
    tail = float(res.x[np.asarray([j.tail for j in model.jobs])].sum())
    return _Solved(
        bound_sum_s=dual,
        primal_sum_s=float(res.fun),
        tail_work=tail,
        slots=len(model.edges) - 1,
        variables=len(c_vec),
    )


def build_lp(
    jobs: list[TraceJob],
    tables: list[JobTables],
    clock: CarbonClock,
    config: SimulationConfig,
    periods_in_span: list[BudgetWindow],
    start_s: float,
    horizon_s: float,
    segments: int,
    limits: list[JobLimits],
    until_s: float,
    extra_edges: np.ndarray | None = None,
    job_ends: list[float] | None = None,
) -> LpModel:
    """The LP of the module docstring over [start_s, horizon_s), slots also cut at
    `extra_edges` (more edges only refine the slots: still a relaxation of every replay);
    `job_ends[j]` (a slot edge, say in `extra_edges`) ends job j's own slots earlier, its
    tail then costing job_ends[j] - release (still a bound, as for the horizon)."""
    periods = _periods_until(config, periods_in_span, horizon_s)
    windows = _windows(config, periods, start_s, horizon_s)
    cuts = (
        [] if extra_edges is None else [BudgetWindow(float(t), float(t), 0.0) for t in extra_edges]
    )
    edges = _boundaries(clock, windows + cuts, start_s, horizon_s)
    begin, end = edges[:-1], edges[1:]
    length = end - begin
    num_slots = len(begin)
    kg_per_w = np.array([clock.kg_per_w(a, b) for a, b in zip(begin, end, strict=True)])

    cost: list[np.ndarray] = []
    lower: list[np.ndarray] = []
    upper: list[np.ndarray] = []
    rows: list[np.ndarray] = []  # A_ub in COO
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    b_ub: list[np.ndarray] = []
    eq_cols: list[np.ndarray] = []
    eq_rows: list[np.ndarray] = []
    # Per-slot GPU use and per-slot power coefficients of x, gathered for capacity and budget.
    x_slot: list[np.ndarray] = []
    x_cols: list[np.ndarray] = []
    x_gpus: list[np.ndarray] = []
    x_power: list[np.ndarray] = []
    tail_cols: list[int] = []
    job_cols: list[JobColumns] = []
    n_var = 0
    n_row = 0
    for j, (job, table, limit) in enumerate(zip(jobs, tables, limits, strict=True)):
        release = job.submission_s
        work = job.total_samples
        rates = np.asarray(table.throughput_samples_per_s)
        p_s = work / rates.max()
        first = max(0, int(np.searchsorted(edges, release, side="right")) - 1)
        # The job's own horizon (a slot edge): work past it goes to its tail, which costs its
        # distance from the release and uses neither capacity nor budget, so any end is valid.
        last = num_slots
        job_end = horizon_s
        if job_ends is not None and job_ends[j] < horizon_s:
            last = max(first + 1, int(np.searchsorted(edges, job_ends[j] + 1e-6, side="right")) - 1)
            job_end = float(edges[last])
        s_idx = np.arange(first, last)
        s_count = len(s_idx)
        a = np.maximum(begin[s_idx], release)
        avail = np.clip((end[s_idx] - a) / length[s_idx], 0.0, 1.0)
        n_counts = len(rates)
        # x[s, c], row-major by slot.
        x_base = n_var
        x_ids = x_base + np.arange(s_count * n_counts).reshape(s_count, n_counts)
        n_var += s_count * n_counts
        cost.append(np.zeros(s_count * n_counts))
        upper.append(np.repeat(avail, n_counts))
        # Segments z[s, m] of y[s]: tangent points 0, u/(M-1), ..., u.
        u = np.minimum(1.0, avail * length[s_idx] / p_s)
        m = max(1, segments)
        if m == 1:
            widths = u[:, None]
            slopes = np.zeros((s_count, 1))
        else:
            frac = np.full(m, 1.0 / (m - 1))
            frac[0] = frac[-1] = 0.5 / (m - 1)
            widths = u[:, None] * frac[None, :]
            slopes = p_s * u[:, None] * (np.arange(m) / (m - 1))[None, :]
        z_ids = n_var + np.arange(s_count * m).reshape(s_count, m)
        n_var += s_count * m
        cost.append(np.zeros(s_count * m))
        upper.append(widths.ravel())
        tail_cols.append(n_var)
        cost.append(np.zeros(1))
        upper.append(np.array([1.0]))
        n_var += 1
        # jct[j] >= the job's undone-work term + its done-work floor, and >= its earliest JCT.
        jct_col = n_var
        n_var += 1
        cost.append(np.ones(1))
        lower.append(np.zeros(s_count * (n_counts + m) + 1))
        lower.append(np.array([limit.earliest_jct_s]))
        upper.append(np.array([max(until_s - release, limit.earliest_jct_s)]))
        rows.append(np.full(s_count * m + 2, n_row))
        cols.append(np.concatenate([z_ids.ravel(), [tail_cols[-1], jct_col]]))
        vals.append(
            np.concatenate([((a - release)[:, None] + slopes).ravel(), [job_end - release, -1.0]])
        )
        b_ub.append(np.array([-limit.done_integral_s]))
        n_row += 1
        job_cols.append(
            JobColumns(first, last, z_ids, tail_cols[-1], jct_col, cols[-1][:-1], vals[-1][:-1])
        )
        # Row: sum_c x[s, c] <= avail[s].
        run_rows = n_row + np.arange(s_count)
        n_row += s_count
        rows.append(np.repeat(run_rows, n_counts))
        cols.append(x_ids.ravel())
        vals.append(np.ones(s_count * n_counts))
        b_ub.append(avail)
        # Row: sum_m z[s, m] - sum_c rate_c len_s / work x[s, c] <= 0.
        prog_rows = n_row + np.arange(s_count)
        n_row += s_count
        rows.append(np.repeat(prog_rows, m))
        cols.append(z_ids.ravel())
        vals.append(np.ones(s_count * m))
        rows.append(np.repeat(prog_rows, n_counts))
        cols.append(x_ids.ravel())
        vals.append((-(length[s_idx, None] * rates[None, :]) / work).ravel())
        b_ub.append(np.zeros(s_count))
        # Row (eq): sum z + tail = 1.
        eq_cols.append(np.concatenate([z_ids.ravel(), [tail_cols[-1]]]))
        eq_rows.append(np.full(s_count * m + 1, j))
        x_slot.append(np.repeat(s_idx, n_counts))
        x_cols.append(x_ids.ravel())
        x_gpus.append(np.tile(np.asarray(table.allowed_gpus, dtype=float), s_count))
        x_power.append(np.tile(np.asarray(table.power_w), s_count))
    all_x_cols = np.concatenate(x_cols)
    slot_of_x = np.concatenate(x_slot)
    # Capacity rows: sum c x <= capacity, per slot.
    rows.append(n_row + slot_of_x)
    cols.append(all_x_cols)
    vals.append(np.concatenate(x_gpus))
    b_ub.append(np.full(num_slots, float(config.capacity_gpus)))
    capacity_rows = n_row + np.arange(num_slots)
    n_row += num_slots
    budget_rows: list[tuple[int, float, float, float]] = []
    # Budget rows: sum P kg_per_w x over the window's slots <= kg.
    power_kg = np.concatenate(x_power) * kg_per_w[slot_of_x]
    for window in windows:
        w_from, w_to, kg = window.start_s, window.end_s, window.budget_kg
        inside = (begin[slot_of_x] >= w_from - 1e-6) & (end[slot_of_x] <= w_to + 1e-6)
        if not inside.any():
            continue
        rows.append(np.full(int(inside.sum()), n_row))
        cols.append(all_x_cols[inside])
        vals.append(power_kg[inside])
        b_ub.append(np.array([kg]))
        budget_rows.append((n_row, w_from, w_to, kg))
        n_row += 1
    c_vec = np.concatenate(cost)
    lb = np.concatenate(lower)
    ub = np.concatenate(upper)
    a_ub = sp.csr_array(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n_row, n_var)
    )
    b_vec = np.concatenate(b_ub)
    ec = np.concatenate(eq_cols)
    a_eq = sp.csr_array((np.ones(len(ec)), (np.concatenate(eq_rows), ec)), shape=(len(jobs), n_var))
    b_eq = np.ones(len(jobs))
    return LpModel(
        c_vec,
        a_ub,
        b_vec,
        a_eq,
        b_eq,
        lb,
        ub,
        edges,
        job_cols,
        kg_per_w,
        capacity_rows,
        budget_rows,
    )


@dataclass(frozen=True)
class JobLimits:
    """Floors on one job's JCT terms from what it alone could do under the budget windows."""

    earliest_jct_s: float  # no schedule within the budgets finishes the job sooner after release
    done_integral_s: float  # no schedule has a smaller int_r^C f dt (at least p / 2)


def job_limits(
    job: TraceJob,
    table: JobTables,
    clock: CarbonClock,
    windows: list[BudgetWindow],
    until_s: float,
    *,
    fine_s: float = FINE_S,
) -> JobLimits:
    """The job's floors among schedules that finish it by `until_s` (module docstring)."""
    release = job.submission_s
    top_rate = float(np.max(table.throughput_samples_per_s)) / job.total_samples  # fraction/s
    half_run_s = 0.5 / top_rate
    stretches = _stretches(job, table, clock, windows, release, until_s)
    earliest = _earliest_finish_s(stretches, top_rate, release)
    if earliest > until_s:
        return JobLimits(until_s - release, half_run_s)
    least = _least_done_integral_s(stretches, top_rate, release, earliest, until_s, fine_s)
    return JobLimits(earliest - release, max(half_run_s, least))


def _stretches(
    job: TraceJob,
    table: JobTables,
    clock: CarbonClock,
    windows: list[BudgetWindow],
    release: float,
    until_s: float,
) -> list[Stretch]:
    """(from_s, to_s, cap) covering [release, until_s): the most work fraction the job alone can
    do inside each budget window (inf between windows, where only its top rate limits it)."""
    out: list[Stretch] = []
    cursor = release
    for window in sorted(windows):
        w_from, w_to, kg = window.start_s, window.end_s, window.budget_kg
        if w_to <= cursor or w_from >= until_s:
            continue
        if w_from > cursor:
            out.append((cursor, w_from, math.inf))
            cursor = w_from
        w_end = min(w_to, until_s)
        out.append((cursor, w_end, _most_work_fraction(job, table, clock, cursor, w_end, kg)))
        cursor = w_end
    if cursor < until_s:
        out.append((cursor, until_s, math.inf))
    return out


def _most_work_fraction(
    job: TraceJob, table: JobTables, clock: CarbonClock, from_s: float, to_s: float, kg: float
) -> float:
    """Upper bound on the work fraction the job alone can do in [from_s, to_s) emitting <= kg.

    Lagrangian of the LP (per series step, time shares of the allowed counts): for any price
    lam >= 0 the most is at most lam kg + sum_steps max(0, max_c gain - lam cost), so the least
    such value over a grid of prices is an upper bound whatever the grid."""
    edges = _boundaries(clock, [], from_s, to_s)
    begin, end = edges[:-1], edges[1:]
    kg_per_w = np.array([clock.kg_per_w(a, b) for a, b in zip(begin, end, strict=True)])
    rates = np.asarray(table.throughput_samples_per_s) / job.total_samples
    gain = (end - begin)[:, None] * rates[None, :]  # work fraction for running the whole step
    cost = kg_per_w[:, None] * np.asarray(table.power_w)[None, :]
    free = float(gain.max(axis=1).sum())
    if kg <= 0:
        return 0.0
    top = float((gain / cost).max())
    lams = np.concatenate([[0.0], top * np.geomspace(1e-6, 1.0, 160)])
    for _ in range(3):
        value = lams * kg + np.maximum(
            0.0, (gain[None] - lams[:, None, None] * cost[None]).max(axis=2)
        ).sum(axis=1)
        i = int(np.argmin(value))
        lo, hi = lams[max(i - 1, 0)], lams[min(i + 1, len(lams) - 1)]
        best = float(value[i])
        lams = np.linspace(lo, hi, 64)
    # Rounding must not leave the cap a hair below the truth: a schedule spending exactly the
    # budget would then look unable to finish inside the window (found by the property test).
    return min(free, best) * (1.0 + 1e-9)


def _earliest_finish_s(stretches: list[Stretch], top_rate: float, release: float) -> float:
    """Earliest time the job can have done all its work (inf: not within the stretches)."""
    done = 0.0
    for s_from, s_to, cap in stretches:
        start = max(s_from, release)
        most = min(cap, (s_to - start) * top_rate)
        if done + most >= 1.0:
            return start + (1.0 - done) / top_rate
        done += most
    return math.inf


def _done_integral_s(
    stretches: list[Stretch],
    top_rate: float,
    release: float,
    finish_s: float,
) -> float:
    """Least int_r^C f dt of a schedule finishing at C = `finish_s`: every stretch's most work
    packed at its end at the top rate, latest first (inf when that does not reach 1)."""
    need = 1.0
    total = 0.0
    for s_from, s_to, cap in reversed(stretches):
        if s_from >= finish_s:
            continue
        hi = min(s_to, finish_s)
        lo = max(s_from, release)
        if hi <= lo:
            break
        piece = min(cap, (hi - lo) * top_rate, need)
        # Work `piece` done at the top rate over [hi - piece / top_rate, hi].
        total += piece * (finish_s - hi + 0.5 * piece / top_rate)
        need -= piece
        if need <= 1e-12:
            return total
    return math.inf


def _least_done_integral_s(
    stretches: list[Stretch],
    top_rate: float,
    release: float,
    earliest: float,
    until_s: float,
    fine_s: float,
) -> float:
    """Lower bound on min over C in [earliest, until_s] of `_done_integral_s` (within fine_s).

    For C in [C0, C1]: int_r^C f >= int_r^C0 f and f(t) >= F_C1(t), the packed profile for
    C1, so the value at C is at least the value at C1 minus C1 - C0 (F <= 1). Intervals whose
    floor can still beat the best value seen are split until no wider than fine_s."""
    floor_s = 0.5 / top_rate  # no schedule does better than running at the top rate throughout
    best = _done_integral_s(stretches, top_rate, release, earliest)
    if best <= floor_s + fine_s:
        return floor_s
    pending = [(earliest, until_s)]
    leaves = best
    evaluations = 0
    while pending:
        c0, c1 = pending.pop()
        width = c1 - c0
        pieces = max(2, min(64, math.ceil(width / fine_s)))
        points = np.linspace(c0, c1, pieces + 1)
        step = width / pieces
        for a, b in itertools.pairwise(points):
            value = _done_integral_s(stretches, top_rate, release, float(b))
            evaluations += 1
            best = min(best, value)
            floor = max(floor_s, value - step)
            if floor >= best:
                continue
            if step <= fine_s or evaluations > MAX_EVALUATIONS:
                leaves = min(leaves, floor)
            else:
                pending.append((float(a), float(b)))
    return min(leaves, best)
