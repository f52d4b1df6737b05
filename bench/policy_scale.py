"""The live policy at cluster scale, in-process: CPU and wall seconds of one cold and one warm
call of `get_policy("greenflow")` (solver, deadline guard, stalls, team budgets), JSON out.

Jobs are `bench.solver_scale`'s (ElasticFlow A100 profiles, 30 % with a deadline; `--no-deadlines`
drops them and gives each job 20x the work, like the service bench's mix); the horizon is the
service's (one day of 300 s slots: 288). The warm call is the same cluster one slot later with
the cold plan as `previous` (`solver_scale.next_tick`), as the control loop's next tick.

Usage:
    python -m bench.policy_scale [--cases 1000:256,5000:2048] [--time-limit-s 5] [--slots 288]
        [--no-deadlines] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np

from bench.solver_scale import DEFAULT_DATA, intensity_day, make_jobs, next_tick
from scheduler_service.allocation.policies import get_policy
from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem

DAY_S = 86_400.0


def problem_of(
    num_jobs: int, gpus: int, slots: int, seed: int, deadlines: bool
) -> AllocationProblem:
    """`num_jobs` jobs of at most 8 GPUs on a `gpus`-GPU cluster over one day of `slots` slots."""
    jobs = make_jobs(num_jobs, 8, DEFAULT_DATA, np.random.default_rng(seed))
    if not deadlines:
        jobs = [
            replace(j, deadline_s=None, remaining_samples=j.remaining_samples * 20) for j in jobs
        ]
    day = intensity_day(DEFAULT_DATA)  # 48 half-hours
    return AllocationProblem(
        start_at=datetime(2021, 1, 1, tzinfo=UTC),
        slot_s=DAY_S / slots,
        capacity_gpus=(gpus,) * slots,
        intensity_g_per_kwh=tuple(day[(t * len(day)) // slots] for t in range(slots)),
        jobs=tuple(jobs),
    )


def timed(
    problem: AllocationProblem, previous: AllocationPlan | None, limit_s: float, seed: int
) -> tuple[AllocationPlan, dict[str, Any]]:
    """One policy call: its plan and figures."""
    wall, cpu = time.perf_counter(), time.process_time()
    plan = get_policy("greenflow")(problem, previous=previous, time_limit_s=limit_s, seed=seed)
    figures = {
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
        "objective": plan.objective,
        "deadline_misses": sum(1 for ok in plan.deadline_met.values() if not ok),
        "step": plan.step,
    }
    return plan, figures


def main() -> None:
    """Run each case cold then warm and print the JSON figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1000:256,5000:2048")
    parser.add_argument("--time-limit-s", type=float, default=5.0)
    parser.add_argument("--slots", type=int, default=288)
    parser.add_argument("--no-deadlines", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cases = []
    for case in args.cases.split(","):
        num_jobs, gpus = (int(x) for x in case.split(":"))
        problem = problem_of(num_jobs, gpus, args.slots, args.seed, not args.no_deadlines)
        cold_plan, cold = timed(problem, None, args.time_limit_s, args.seed)
        _, warm = timed(next_tick(problem, cold_plan), cold_plan, args.time_limit_s, args.seed)
        cases.append({"jobs": num_jobs, "gpus": gpus, "cold": cold, "warm": warm})
    setup = {
        "slots": args.slots,
        "time_limit_s": args.time_limit_s,
        "deadlines": not args.no_deadlines,
        "load_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps({"cases": cases, "setup": setup}, indent=2))


if __name__ == "__main__":
    main()
