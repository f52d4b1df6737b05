"""The time-indexed allocation model, built in one go from numpy arrays (CSR matrix).

Variables (all in one vector, minimised):
  x[o, t]  share of slot t that job option o (job j at one allowed count) runs; binary in the MIP
  c[j, t]  cumulative progress of job j by the end of slot t (fraction of its remaining work)
  d[j, t]  min(1, c[j, t]): the finished fraction (continuous: the objective is fractional
           completion time, the area under each job's remaining-work curve)
  l[j]     leftover work fraction after the horizon (l >= 1 - c[j, T-1])
  m[j]     1 when job j misses its deadline (deadline jobs only)
  h[j, t]  1 when job j changes GPU count at the start of slot t (MIP only)
The objective, divided by slot_s, equals `plan_objective` up to a constant:
  sum_j w_j (T - sum_t d[j,t] + l_j tail_j) + M sum_j m_j + price * emissions + change * sum h.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from scheduler_service.allocation.problem import AllocationProblem, BudgetMode, PlanArrays

if TYPE_CHECKING:
    import scipy.sparse as sp

INF = np.inf


@dataclass
class BuiltModel:
    """A model as sparse data plus the index maps needed to read a solution back."""

    lower: np.ndarray
    upper: np.ndarray
    cost: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    matrix: sp.csr_matrix
    integer: np.ndarray  # bool mask of integer variables (used in the MIP only)
    offset: float  # objective constant (in units of slot_s)
    opt_job: np.ndarray  # job index of each option
    opt_k: np.ndarray  # option position within its job
    x_start: int
    c_start: int
    d_start: int
    num_slots: int


class _Rows:
    """Collects sparse triplets row by row-block."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.lo: list[np.ndarray] = []
        self.hi: list[np.ndarray] = []
        self.count = 0

    def block(self, n: int, lo: np.ndarray | float, hi: np.ndarray | float) -> int:
        start = self.count
        self.count += n
        self.lo.append(np.broadcast_to(np.asarray(lo, dtype=float), (n,)).copy())
        self.hi.append(np.broadcast_to(np.asarray(hi, dtype=float), (n,)).copy())
        return start

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray | float) -> None:
        rows = np.asarray(rows, dtype=np.int64).ravel()
        cols = np.asarray(cols, dtype=np.int64).ravel()
        self.rows.append(rows)
        self.cols.append(cols)
        self.vals.append(np.broadcast_to(np.asarray(vals, dtype=float), rows.shape).ravel().copy())

    def matrix(self, n_vars: int) -> sp.csr_matrix:
        """The collected triplets as one CSR matrix (repeated entries summed)."""
        # scipy is imported at the first build, in the loop's thread: at module level it cost
        # `greenflow serve` about a second before /healthz answered (api -> admission -> solver).
        import scipy.sparse as sp

        out = sp.csr_matrix(
            (np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
            shape=(self.count, n_vars),
        )
        out.sum_duplicates()
        return out


def build_model(
    problem: AllocationProblem, arrays: PlanArrays, *, with_changes: bool
) -> BuiltModel:
    """Assemble the LP/MIP of a problem; `with_changes` adds the change-counting variables."""
    num_jobs, num_slots = arrays.num_jobs, problem.num_slots
    opt_job, opt_k = np.nonzero(arrays.valid)
    num_opts = len(opt_job)
    slot_s = problem.slot_s
    w = arrays.priority
    deadline_jobs = [i for i, j in enumerate(problem.jobs) if j.deadline_s is not None]
    num_dl = len(deadline_jobs)

    x0 = 0
    c0 = x0 + num_opts * num_slots
    d0 = c0 + num_jobs * num_slots
    l0 = d0 + num_jobs * num_slots
    m0 = l0 + num_jobs
    h0 = m0 + num_dl
    n_vars = h0 + (num_jobs * num_slots if with_changes else 0)

    lower = np.zeros(n_vars)
    upper = np.full(n_vars, INF)
    cost = np.zeros(n_vars)
    integer = np.zeros(n_vars, dtype=bool)
    upper[x0:c0] = 1.0
    too_big = arrays.gpus[opt_job, opt_k][:, None] > np.asarray(problem.capacity_gpus)[None, :]
    upper[x0:c0][too_big.ravel()] = 0.0  # a count above a slot's capacity cannot run there
    upper[d0:l0] = 1.0
    upper[m0:h0] = 1.0
    upper[h0:] = 1.0
    integer[x0:c0] = True
    integer[m0:h0] = True
    integer[h0:] = True

    def xi(o: np.ndarray | int, t: np.ndarray | int) -> np.ndarray:
        return np.asarray(x0 + o * num_slots + t)

    def ci(j: np.ndarray | int, t: np.ndarray | int) -> np.ndarray:
        return np.asarray(c0 + j * num_slots + t)

    slots = np.arange(num_slots)
    kg_per_w = problem.slot_emissions_kg_per_w()
    power = arrays.power_w[opt_job, opt_k]
    # Emissions of each x (kg) and progress of each x (fraction of remaining work).
    x_kg = power[:, None] * kg_per_w[None, :]
    x_progress = arrays.progress[opt_job, opt_k]

    # Objective (divided by slot_s): finished slots earn w, leftover costs w * tail, misses M.
    cost[d0:l0] = -np.repeat(w, num_slots)
    cost[l0:m0] = w * arrays.tail_slots + (problem.carbon_price_s_per_kg / slot_s) * arrays.tail_kg
    miss_cost = problem.deadline_miss_cost_s() / slot_s
    cost[m0:h0] = miss_cost
    cost[x0:c0] = (problem.carbon_price_s_per_kg / slot_s) * x_kg.ravel()
    if with_changes:
        cost[h0:] = problem.change_cost_s / slot_s
    offset = float(w.sum() * num_slots)

    r = _Rows()
    # One option at most per job and slot.
    start = r.block(num_jobs * num_slots, -INF, 1.0)
    oo, tt = np.meshgrid(np.arange(num_opts), slots, indexing="ij")
    r.add(start + opt_job[oo] * num_slots + tt, xi(oo, tt), 1.0)

    # Capacity per slot.
    start = r.block(num_slots, -INF, np.asarray(problem.capacity_gpus, dtype=float))
    gpus = arrays.gpus[opt_job, opt_k].astype(float)
    r.add(start + tt, xi(oo, tt), np.repeat(gpus, num_slots))

    # Cumulative progress: c[j,t] - c[j,t-1] - sum_o p_o x[o,t] = 0.
    start = r.block(num_jobs * num_slots, 0.0, 0.0)
    jj, ts = np.meshgrid(np.arange(num_jobs), slots, indexing="ij")
    r.add(start + jj * num_slots + ts, ci(jj, ts), 1.0)
    jj1, ts1 = jj[:, 1:], ts[:, 1:]
    r.add(start + jj1 * num_slots + ts1, ci(jj1, ts1 - 1), -1.0)
    r.add(start + opt_job[oo] * num_slots + tt, xi(oo, tt), -np.repeat(x_progress, num_slots))

    # Finished only when the work is done: d[j,t] - c[j,t] <= 0.
    start = r.block(num_jobs * num_slots, -INF, 0.0)
    r.add(start + jj * num_slots + ts, d0 + jj * num_slots + ts, 1.0)
    r.add(start + jj * num_slots + ts, ci(jj, ts), -1.0)

    # Leftover after the horizon: l[j] + c[j,T-1] >= 1.
    start = r.block(num_jobs, 1.0, INF)
    jobs_idx = np.arange(num_jobs)
    r.add(start + jobs_idx, l0 + jobs_idx, 1.0)
    r.add(start + jobs_idx, ci(jobs_idx, np.full(num_jobs, num_slots - 1)), 1.0)

    # Deadlines: progress by the deadline + m[j] >= 1.
    if num_dl:
        start = r.block(num_dl, 1.0, INF)
        for n, j in enumerate(deadline_jobs):
            job = problem.jobs[j]
            row = np.array([start + n])
            r.add(row, np.array([m0 + n]), 1.0)
            assert job.deadline_s is not None
            if problem.deadline_impossible(job):
                lower[m0 + n] = 1.0  # missed in every plan: fixing it tightens the LP bound
            if job.deadline_s >= problem.horizon_s:
                # Work after the horizon at full speed still counts towards a later deadline.
                extra = (job.deadline_s - problem.horizon_s) / (
                    arrays.remaining[j] / arrays.max_throughput[j]
                )
                r.lo[-1][n] = 1.0 - extra
                r.add(row, np.array([ci(j, num_slots - 1)]), 1.0)
                continue
            pos = problem.deadline_position(job)
            assert pos is not None
            slot, frac = pos
            if slot >= 1:
                r.add(row, np.array([ci(j, slot - 1)]), 1.0 - frac)
            if frac > 0:
                r.add(row, np.array([ci(j, slot)]), frac)

    # Hard budget per period.
    if problem.budget_mode is BudgetMode.HARD:
        periods = problem.period_slots()
        if periods:
            budgets = np.array([p.budget_left_kg for p, _ in periods])
            start = r.block(len(periods), -INF, np.maximum(budgets, 0.0))
            for n, (_, share) in enumerate(periods):
                r.add(
                    np.full(num_opts * num_slots, start + n),
                    xi(oo, tt),
                    (x_kg * share[None, :]).ravel(),
                )

    if with_changes:
        # h[j,t] >= x[o,t] - x[o,t-1] (a rise of any option) and
        # h[j,t] >= sum x[.,t-1] - sum x[.,t] - d[j,t-1] (stopping before the job is done).
        prev_active = np.zeros(num_opts)
        for o in range(num_opts):
            job = problem.jobs[opt_job[o]]
            prev_active[o] = 1.0 if job.allowed_gpus[opt_k[o]] == job.current_gpus else 0.0
        start = r.block(num_opts * num_slots, -INF, INF)
        rows = start + oo * num_slots + tt
        r.lo[-1][:] = -np.repeat(prev_active, num_slots) * (tt.ravel() == 0).astype(float)
        r.add(rows, h0 + opt_job[oo] * num_slots + tt, 1.0)
        r.add(rows, xi(oo, tt), -1.0)
        r.add(rows[:, 1:], xi(oo[:, 1:], tt[:, 1:] - 1), 1.0)
        start = r.block(num_jobs * num_slots, -INF, INF)
        rows = start + jj * num_slots + ts
        current = np.array([1.0 if j.current_gpus else 0.0 for j in problem.jobs])
        lo = np.zeros((num_jobs, num_slots))
        lo[:, 0] = current
        r.lo[-1][:] = lo.ravel()
        r.add(rows, h0 + jj * num_slots + ts, 1.0)
        r.add(start + opt_job[oo] * num_slots + tt, xi(oo, tt), 1.0)
        r.add(
            start + opt_job[oo[:, 1:]] * num_slots + tt[:, 1:],
            xi(oo[:, 1:], tt[:, 1:] - 1),
            -1.0,
        )
        r.add(rows[:, 1:], d0 + jj1 * num_slots + ts1 - 1, 1.0)

    matrix = r.matrix(n_vars)
    return BuiltModel(
        lower=lower,
        upper=upper,
        cost=cost,
        row_lower=np.concatenate(r.lo),
        row_upper=np.concatenate(r.hi),
        matrix=matrix,
        integer=integer,
        offset=offset,
        opt_job=opt_job,
        opt_k=opt_k,
        x_start=x0,
        c_start=c0,
        d_start=d0,
        num_slots=num_slots,
    )


@dataclass
class CompactLp:
    """The LP relaxation with progress substituted out: variables are x[o, t] then m[deadline]."""

    lower: np.ndarray
    upper: np.ndarray
    cost: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    matrix: sp.csr_matrix
    offset: float
    opt_job: np.ndarray
    opt_k: np.ndarray
    progress: np.ndarray  # per option: fraction of the job's remaining work done per whole slot
    num_slots: int


def build_compact_lp(problem: AllocationProblem, arrays: PlanArrays) -> CompactLp:
    """LP relaxation of `build_model` with c, d and l eliminated (about 3x fewer rows).

    Capping each job's total progress at its remaining work makes d = c exact, so the objective
    becomes linear in x: progress in slot t earns w * (T - t) (finished fraction at every later
    slot end) plus w * tail (less leftover). Any integer plan, with its finishing slot scaled
    down to the exact remaining work, is feasible here at no higher cost: the bound stays valid.
    """
    num_jobs, num_slots = arrays.num_jobs, problem.num_slots
    opt_job, opt_k = np.nonzero(arrays.valid)
    num_opts = len(opt_job)
    slot_s = problem.slot_s
    w = arrays.priority
    deadline_jobs = [i for i, j in enumerate(problem.jobs) if j.deadline_s is not None]
    num_dl = len(deadline_jobs)
    n_x = num_opts * num_slots
    # Deadlines inside a slot: y[o] is the part of the slot run at option o before the deadline
    # (a job runs from the slot's start), y[o] <= fraction before the deadline * x[o, slot].
    in_slot = []
    for n, j in enumerate(deadline_jobs):
        pos = problem.deadline_position(problem.jobs[j])
        assert pos is not None
        if pos[0] < num_slots and pos[1] > 0:
            in_slot.append((n, j, pos[0], pos[1]))
    y_opts = [np.flatnonzero(opt_job == j) for _, j, _, _ in in_slot]
    n_y = int(sum(len(o) for o in y_opts))
    # e[o] (one per y): the rest of the deadline slot that running o before the deadline books.
    n_vars = n_x + num_dl + 2 * n_y
    lower = np.zeros(n_vars)
    upper = np.ones(n_vars)
    too_big = arrays.gpus[opt_job, opt_k][:, None] > np.asarray(problem.capacity_gpus)[None, :]
    upper[:n_x][too_big.ravel()] = 0.0
    slots = np.arange(num_slots)
    kg_per_w = problem.slot_emissions_kg_per_w()
    power = arrays.power_w[opt_job, opt_k]
    x_kg = power[:, None] * kg_per_w[None, :]
    progress = arrays.progress[opt_job, opt_k]
    # Objective / slot_s: sum_j w_j (T - sum_t c_t) + w_j tail_j (1 - c_T) + price (kg + tail kg).
    later = (num_slots - slots).astype(float)  # slot t's progress counts at ends t..T-1
    tail_value = w * arrays.tail_slots + (problem.carbon_price_s_per_kg / slot_s) * arrays.tail_kg
    gain = (w[opt_job][:, None] * later[None, :] + tail_value[opt_job][:, None]) * progress[:, None]
    cost = np.zeros(n_vars)
    cost[:n_x] = (-gain + (problem.carbon_price_s_per_kg / slot_s) * x_kg).ravel()
    miss_cost = problem.deadline_miss_cost_s() / slot_s
    cost[n_x : n_x + num_dl] = miss_cost
    offset = float((w * num_slots + tail_value).sum())

    r = _Rows()
    oo, tt = np.meshgrid(np.arange(num_opts), slots, indexing="ij")
    xcol = oo * num_slots + tt
    one_row = r.block(num_jobs * num_slots, -INF, 1.0)
    r.add(one_row + opt_job[oo] * num_slots + tt, xcol, 1.0)
    cap_row = r.block(num_slots, -INF, np.asarray(problem.capacity_gpus, dtype=float))
    r.add(cap_row + tt, xcol, np.repeat(arrays.gpus[opt_job, opt_k].astype(float), num_slots))
    # Total progress at most the remaining work.
    start = r.block(num_jobs, -INF, 1.0)
    r.add(start + opt_job[oo], xcol, np.repeat(progress, num_slots))
    if num_dl:
        start = r.block(num_dl, 1.0, INF)
        row_of_job = np.full(num_jobs, -1)
        row_of_job[deadline_jobs] = np.arange(num_dl)
        weight = np.zeros((num_jobs, num_slots))
        for n, j in enumerate(deadline_jobs):
            job = problem.jobs[j]
            assert job.deadline_s is not None
            if problem.deadline_impossible(job):
                lower[n_x + n] = 1.0  # missed in every plan (relative_gap relies on it)
            if job.deadline_s >= problem.horizon_s:
                extra = (job.deadline_s - problem.horizon_s) / (
                    arrays.remaining[j] / arrays.max_throughput[j]
                )
                r.lo[-1][n] = 1.0 - extra
                weight[j, :] = 1.0
                continue
            pos = problem.deadline_position(job)
            assert pos is not None
            slot, frac = pos
            weight[j, :slot] = 1.0
        sel = row_of_job[opt_job] >= 0
        o_sel = oo[sel]
        t_sel = tt[sel]
        vals = weight[opt_job[o_sel], t_sel] * progress[o_sel]
        keep = vals > 0
        r.add(
            start + row_of_job[opt_job[o_sel]][keep], (o_sel * num_slots + t_sel)[keep], vals[keep]
        )
        r.add(start + np.arange(num_dl), n_x + np.arange(num_dl), 1.0)
        y0 = n_x + num_dl
        for (n, _, slot, frac), opts in zip(in_slot, y_opts, strict=True):
            ys = y0 + np.arange(len(opts))
            r.add(np.full(len(opts), start + n), ys, progress[opts])
            # y[o] <= frac * (x[o, slot] + e[o]), with e booked in the slot's capacity and
            # one-option rows but earning no progress: a plan books whole slots, so running an
            # option before the deadline books it for the whole slot. Valid for every integer
            # plan (x = 1, y = frac; when its finishing slot is scaled down to the exact
            # remaining work, e takes up the rest of the booking); it implies y <= x + e and
            # sum_o y <= frac, and keeps the bound from time-sharing a slot the deadline cuts.
            es = ys + n_y
            link = r.block(len(opts), -INF, 0.0)
            r.add(link + np.arange(len(opts)), ys, 1.0)
            r.add(link + np.arange(len(opts)), opts * num_slots + slot, -frac)
            r.add(link + np.arange(len(opts)), es, -frac)
            r.add(cap_row + np.full(len(opts), slot), es, arrays.gpus[opt_job[opts], opt_k[opts]])
            r.add(one_row + opt_job[opts] * num_slots + slot, es, 1.0)
            y0 += len(opts)
    if problem.budget_mode is BudgetMode.HARD:
        periods = problem.period_slots()
        if periods:
            budgets = np.array([p.budget_left_kg for p, _ in periods])
            start = r.block(len(periods), -INF, np.maximum(budgets, 0.0))
            for n, (_, share) in enumerate(periods):
                r.add(np.full(n_x, start + n), xcol, (x_kg * share[None, :]).ravel())
    matrix = r.matrix(n_vars)
    return CompactLp(
        lower=lower,
        upper=upper,
        cost=cost,
        row_lower=np.concatenate(r.lo),
        row_upper=np.concatenate(r.hi),
        matrix=matrix,
        offset=offset,
        opt_job=opt_job,
        opt_k=opt_k,
        progress=progress,
        num_slots=num_slots,
    )
