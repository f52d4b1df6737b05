"""OR-Tools ModelBuilder + HiGHS: the LP relaxation and the exact MIPs of the allocation model.

Why HiGHS (measured on the 2-core dev machine, docs/allocation.md "How `solve` works"): faster
than GLOP or PDLP on the compact LP, 1.4-2x faster than SCIP on small time-indexed MIPs. CP-SAT
is not used: the model has continuous progress variables, which CP-SAT cannot represent exactly.
The MIPs stop on a node limit (work, not seconds) so answers do not depend on load.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from scheduler_service.allocation.model import (
    BuiltModel,
    CompactLp,
    build_compact_lp,
    build_model,
)
from scheduler_service.allocation.problem import AllocationProblem, PlanArrays
from scheduler_service.allocation.steps import TUNING

if TYPE_CHECKING:
    from ortools.linear_solver.python import model_builder as mb


@cache
def _model_builder() -> ModuleType:
    """OR-Tools' model builder, imported at the first solve: it pulls in pandas (~1.3 s), which
    `greenflow serve` should not wait for before it answers /healthz."""
    from ortools.linear_solver.python import model_builder

    return model_builder


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
    model = _model_builder().Model()
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
    mb = _model_builder()
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
    seed: int,
    *,
    max_nodes: int | None = TUNING.mip_max_nodes,
    safety_net_s: float = TUNING.mip_safety_net_s,
) -> tuple[dict[str, tuple[int, ...]] | None, float | None, bool]:
    """Exact MIP with HiGHS: (GPU matrix or None, best bound, proven optimal).

    Bounded by `max_nodes` (deterministic; None = no node limit) and by `safety_net_s` of wall
    clock, which a normal call never reaches.
    """
    built = build_model(problem, arrays, with_changes=True)
    model = _to_model(built, integer=True)
    # No solution hint: OR-Tools 9.15 segfaults passing hints to HiGHS (reproduced here). The
    # warm start lives on as a candidate plan that the MIP's answer must beat (see `solve`).
    mb = _model_builder()
    solver = mb.Solver("highs")
    solver.set_time_limit_in_seconds(safety_net_s)
    nodes = "" if max_nodes is None else f"mip_max_nodes={int(max_nodes)}\n"
    solver.set_solver_specific_parameters(
        f"output_flag=false\nthreads=1\nrandom_seed={int(seed)}\nmip_rel_gap=1e-4\n{nodes}"
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
