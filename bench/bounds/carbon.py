"""A lower bound on the kg any schedule emits meeting a given set of deadlines (an LP).

Used by bench/schedule_quality.py for `carbon_at_same_deadline_ratio`'s upper bound: no policy
meeting the deadlines carbon-agnostic meets can save more against it than
1 - least_kg / carbon-agnostic's kg.

The relaxation, checked against `engine.simulate_trace`'s semantics (unlimited budget, PUE 1):
time is cut at every job's submission and deadline and at every step of the intensity series
(where `CarbonClock` maps it onto trace time, wrapping as the replay does), so each piece p has
one intensity. y[j, c, p] >= 0: seconds job j runs at allowed count c inside piece p, for the
jobs whose deadlines are met. Each piece is valued at the series' own intensity then, however far
past any planning horizon it lies: a 13-day window is valued day by day, not at some horizon's
cleanest hour (which would make the figure a bound on nothing the replay charges).
- sum_c y[j, c, p] <= len_p, only pieces inside [submission, deadline] (a job runs at one count
  at a time, after it joined);
- sum_(c, p) rate_c y[j, c, p] / work_j >= 1 (a switch stall makes no progress: real <= nominal);
- sum_(j, c) c y[j, c, p] <= capacity len_p (the other jobs only take capacity away);
- minimise sum P_c kg_per_w(p) / len_p y[j, c, p] (the engine charges power through the stalls
  too, and work after a deadline only adds kg).
Any replay meeting those deadlines maps to a feasible point (its other jobs only add kg), so its
kg is at least the optimum. Mixing counts and hours is allowed and capacity is shared: unlike
each job alone at one count in its cleanest hour (the earlier bound), a job that needs most of
its window at full width cannot move its work to a cleaner hour, and a job may mix counts.

Why a fixed set and not "any K deadlines": the cheapest K of the 100-job ITP slice are its small
jobs, so that bound allows a 95 % saving (CAISO) by turning the long jobs away; the figure is
meant for the same work.

The answer is a Lagrangian dual value from HiGHS's duals (every variable is boxed), a bound by
weak duality whatever the solver's tolerances were.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from energy_model.profiles import ScalingProfile
from scheduler_service.simulate.engine import CarbonClock
from scheduler_service.simulate.trace import TraceJob, job_tables


class CarbonBoundError(RuntimeError):
    """The LP did not solve (the message says how)."""


@dataclass(frozen=True)
class CarbonBound:
    """The least kg (a lower bound) and the LP's size."""

    kg: float
    jobs: int  # deadline jobs in the LP
    pieces: int
    variables: int


def step_marks_s(clock: CarbonClock, start_s: float, end_s: float) -> np.ndarray:
    """Trace times strictly inside (start_s, end_s) where the clock's intensity may change:
    every step of its series, repeated each time the series wraps."""
    offsets = clock.step_offsets_s
    first, last = int(start_s // clock.span_s), int(end_s // clock.span_s)
    times = np.concatenate([k * clock.span_s + offsets for k in range(first, last + 1)])
    return times[(times > start_s) & (times < end_s)]


def least_kg_meeting(
    jobs: list[TraceJob],
    met_ids: Collection[str],
    clock: CarbonClock,
    profiles: dict[str, ScalingProfile],
    capacity_gpus: int,
) -> CarbonBound:
    """A lower bound on the kg of any replay of `jobs` meeting the deadlines of `met_ids` on a
    `capacity_gpus` cluster (the module docstring's LP)."""
    wanted = set(met_ids)
    due = [
        j
        for j in jobs
        if j.job_id in wanted and j.deadline_s is not None and j.deadline_s > j.submission_s
    ]
    if not due:
        return CarbonBound(0.0, 0, 0, 0)
    marks: set[float] = set()
    for job in due:
        assert job.deadline_s is not None
        marks |= {job.submission_s, job.deadline_s}
        marks |= set(step_marks_s(clock, job.submission_s, job.deadline_s).tolist())
    edges = sorted(marks)
    pieces = [(a, b) for a, b in itertools.pairwise(edges) if b > a + 1e-9]
    lengths = np.array([b - a for a, b in pieces])
    kg_per_ws = np.array([clock.kg_per_w(a, b) for a, b in pieces]) / lengths
    # Columns: y[j, c, p].
    col_job: list[int] = []
    col_piece: list[int] = []
    col_gpus: list[int] = []
    col_rate: list[float] = []
    col_watts: list[float] = []
    for i, job in enumerate(due):
        assert job.deadline_s is not None
        tables = job_tables(job, profiles, capacity_gpus)
        for p, (a, b) in enumerate(pieces):
            if a < job.submission_s - 1e-9 or b > job.deadline_s + 1e-9:
                continue
            for g, rate, watts in zip(
                tables.allowed_gpus,
                tables.throughput_samples_per_s,
                tables.power_w,
                strict=True,
            ):
                if g <= capacity_gpus:
                    col_job.append(i)
                    col_piece.append(p)
                    col_gpus.append(g)
                    col_rate.append(rate / job.total_samples)
                    col_watts.append(watts)
    n_y, n_jobs, n_pieces = len(col_job), len(due), len(pieces)
    jobs_idx = np.array(col_job)
    pieces_idx = np.array(col_piece)
    y_cols = np.arange(n_y)
    c = np.array(col_watts) * kg_per_ws[pieces_idx]
    # Rows: one count at a time [job, piece]; capacity [piece]; the work done, -sum <= -1 [job].
    rows = np.concatenate(
        [
            jobs_idx * n_pieces + pieces_idx,
            n_jobs * n_pieces + pieces_idx,
            n_jobs * n_pieces + n_pieces + jobs_idx,
        ]
    )
    cols = np.concatenate([y_cols, y_cols, y_cols])
    vals = np.concatenate([np.ones(n_y), np.array(col_gpus, float), -np.array(col_rate)])
    b_ub = np.concatenate([np.tile(lengths, n_jobs), capacity_gpus * lengths, -np.ones(n_jobs)])
    lb = np.zeros(n_y)
    ub = lengths[pieces_idx]
    a_ub = sp.csr_array((vals, (rows, cols)), shape=(len(b_ub), n_y))
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=np.column_stack([lb, ub]), method="highs")
    if res.status != 0:
        raise CarbonBoundError(f"carbon bound LP ended with status {res.status}: {res.message}")
    # Weak duality with any multipliers y_ub <= 0 (scipy's sign): a bound for sure.
    y_ub = np.minimum(np.asarray(res.ineqlin.marginals), 0.0)
    reduced = c - a_ub.T @ y_ub
    dual = float(np.minimum(reduced * lb, reduced * ub).sum() + y_ub @ b_ub)
    return CarbonBound(max(0.0, dual), n_jobs, n_pieces, n_y)
