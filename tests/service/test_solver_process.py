"""The control loop's solve in a worker process gives the plan the policy gives in the loop's own
thread (same problem, previous plan and seed), reports its CPU seconds, and a dead worker is
replaced at the next solve."""

from __future__ import annotations

import os
import signal
from concurrent.futures.process import BrokenProcessPool

import pytest

from scheduler_service.allocation.policies import get_policy
from scheduler_service.solver_process import SolverClosed, SolverProcess
from tests.allocation.test_solver import job, problem


def test_the_worker_plans_what_the_policy_plans_in_process_and_survives_its_death() -> None:
    cold = problem((job("a", 3.0), job("b", 1.0, deadline_h=2.0), job("c", 5.0)))
    policy = get_policy("greenflow")
    here = policy(cold, previous=None, time_limit_s=1.0, seed=3)
    warm_here = policy(cold, previous=here, time_limit_s=1.0, seed=3)
    solver = SolverProcess("greenflow")
    try:
        there, cpu_s = solver.solve(cold, None, 1.0, 3)
        assert (there.gpus, there.deadline_met, there.objective) == (
            here.gpus,
            here.deadline_met,
            here.objective,
        )
        assert cpu_s > 0
        # Warm-started from the plan in force, as the loop's next tick is.
        warm_there, _ = solver.solve(cold, there, 1.0, 3)
        assert (warm_there.gpus, warm_there.objective) == (warm_here.gpus, warm_here.objective)

        # A worker killed (out of memory, say) fails that solve; the next one starts a new worker.
        assert solver._pool is not None
        (worker,) = solver._pool._processes.values()
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        with pytest.raises(BrokenProcessPool):
            solver.solve(cold, None, 1.0, 3)
        again, _ = solver.solve(cold, None, 1.0, 3)
        assert again.gpus == here.gpus
    finally:
        solver.close()


def test_a_closed_solver_starts_no_worker() -> None:
    solver = SolverProcess("greenflow")
    solver.close()
    # A warm-up still running in a thread when the loop stopped does nothing; a solve refuses.
    solver.warm_up()
    assert solver._pool is None
    with pytest.raises(SolverClosed):
        solver.solve(problem((job("a", 1.0),)), None, 1.0, 0)
    assert solver._pool is None
