"""The control loop's solve in a worker process (`[planner] solver_process`, on in `greenflow
serve`): a solve of seconds at thousands of jobs then has its own interpreter and GIL, so it does
not wait for the API's threads (heartbeats, telemetry, reads) nor stall them.

The worker is one long-lived process (spawned, not forked: the server has threads and open
connections), started at the first solve or by `warm_up`. The problem and the previous plan
travel pickled (about 0.1 s both ways at 5,000 jobs x 288 slots); the plan is the policy's own,
so a fixed seed gives the same plan as a solve in the server's process.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from scheduler_service.allocation.policies import Policy, get_policy
from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem

log = logging.getLogger("greenflow.solver")

# The worker's policies by name, built once per worker.
_POLICIES: dict[str, Policy] = {}


def _worker_started(parent_pid: int) -> None:
    """In the worker: Ctrl-C is the server's to handle, and the worker ends with the server even
    when that was killed (no shutdown ran)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, name="greenflow-solver-parent", daemon=True).start()


def _import_solver() -> None:
    """In the worker: load what the first solve would (OR-Tools with pandas)."""
    importlib.import_module("ortools.linear_solver.python.model_builder")


def _solve(
    policy_name: str,
    problem: AllocationProblem,
    previous: AllocationPlan | None,
    time_limit_s: float,
    seed: int,
) -> tuple[AllocationPlan, float]:
    """In the worker: the policy's plan for `problem`, and the CPU seconds it took."""
    policy = _POLICIES.get(policy_name)
    if policy is None:
        policy = _POLICIES[policy_name] = get_policy(policy_name)
    began_s = time.process_time()
    plan = policy(problem, previous=previous, time_limit_s=time_limit_s, seed=seed)
    return plan, time.process_time() - began_s


class SolverClosed(RuntimeError):
    """The solver's worker process was closed (the control loop is stopping)."""


class SolverProcess:
    """Solves with one policy in a worker process (thread-safe; one solve at a time)."""

    def __init__(self, policy_name: str) -> None:
        get_policy(policy_name)  # an unknown name fails here, not at the first tick
        self.policy_name = policy_name
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            # Closed stays closed: a warm-up or solve still running in a thread when the loop
            # stopped would otherwise start a worker nobody ends.
            if self._closed:
                raise SolverClosed("the solver's worker process is closed")
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_started,
                    initargs=(os.getpid(),),
                )
            return self._pool

    def warm_up(self) -> None:
        """Start the worker and load the solver's libraries in it (between ticks); nothing once
        closed."""
        try:
            self._executor().submit(_import_solver).result()
        except RuntimeError:  # closed meanwhile (a shut-down pool refuses work)
            if not self._closed:
                raise

    def solve(
        self,
        problem: AllocationProblem,
        previous: AllocationPlan | None,
        time_limit_s: float,
        seed: int,
    ) -> tuple[AllocationPlan, float]:
        """The policy's plan, solved in the worker (blocks the calling thread only), and the CPU
        seconds the worker spent on it."""
        pool = self._executor()
        try:
            return pool.submit(
                _solve, self.policy_name, problem, previous, time_limit_s, seed
            ).result()
        except BrokenProcessPool:
            # The worker died (killed, out of memory): the next solve starts a new one; this
            # tick fails and is retried after the loop's backoff.
            log.error("the solver's worker process ended; starting a new one at the next solve")
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise

    def close(self) -> None:
        """End the worker (a solve in progress is abandoned)."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._closed = True
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
