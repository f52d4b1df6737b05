"""Solver scale: solve time and gap to the LP bound for 100-5,000 jobs x 48 slots (JSON out).

Jobs are drawn from the ElasticFlow A100 scaling profiles (model, batch size) with power from
energy_model.power; remaining work is 0.5-12 h at one GPU; 30 % of jobs get a deadline between
0.7x and 2x their fastest possible run time. Carbon: a day of US-CAL-CISO 2021 (hourly) when the
shared data is present, else a synthetic day curve. Usage:
    python bench/solver_scale.py [--data DIR] [--cases 100:256,1000:2048,5000:8192] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from energy_model.carbon.series import load_intensity_csv
from energy_model.power import job_power_w
from energy_model.profiles import load_scaling_profiles
from scheduler_service.allocation.problem import AllocationProblem, JobSpec
from scheduler_service.allocation.solver import solve

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SLOT_S = 1800.0
SLOTS = 48


def make_jobs(num_jobs: int, max_gpus: int, data: Path, rng: np.random.Generator) -> list[JobSpec]:
    """Random jobs with measured throughput tables (or a synthetic curve without the data)."""
    profiles_dir = data / "elasticflow" / "throughputs_A100"
    tables: list[dict[int, float]] = []
    if profiles_dir.is_dir():
        for profile in load_scaling_profiles(profiles_dir).values():
            for batch in profile.batch_sizes():
                table = profile.samples_per_s(batch)
                if table:
                    tables.append(table)
    else:
        tables = [{g: 100.0 * g**0.8 for g in (1, 2, 4, 8, 16, 32, 64)}]
    jobs = []
    for i in range(num_jobs):
        table = tables[int(rng.integers(len(tables)))]
        counts: list[int] = []
        rates: list[float] = []
        for g in sorted(table):
            if g <= max_gpus and (not rates or table[g] > rates[-1]):
                counts.append(g)
                rates.append(table[g])
        single = table.get(1, rates[0] / counts[0])
        power = [job_power_w(g, r, single) for g, r in zip(counts, rates, strict=True)]
        remaining = single * 3600.0 * float(rng.uniform(0.5, 12.0))
        deadline = None
        if rng.random() < 0.3:
            deadline = remaining / max(rates) * float(rng.uniform(0.7, 2.0))
        jobs.append(
            JobSpec(
                job_id=f"j{i}",
                allowed_gpus=tuple(counts),
                throughput_samples_per_s=tuple(rates),
                power_w=tuple(power),
                remaining_samples=remaining,
                deadline_s=deadline,
                priority=float(rng.choice([1.0, 1.0, 2.0])),
                current_gpus=0,
            )
        )
    return jobs


def intensity_day(data: Path) -> list[float]:
    """48 half-hour intensities: the first day of US-CAL-CISO 2021, or a synthetic dip."""
    path = data / "carbon" / "electricitymaps" / "US-CAL-CISO_2021_hourly.csv"
    if path.is_file():
        values = list(load_intensity_csv(path).intensity_g_per_kwh[:24])
        return [v for v in values for _ in range(2)]
    return [250.0 - 120.0 * np.sin(np.pi * t / SLOTS) for t in range(SLOTS)]


def run_case(
    num_jobs: int, gpus: int, data: Path, seed: int, time_limit_s: float
) -> dict[str, object]:
    """Solve one case cold, then once more warm-started from its own plan one slot later."""
    rng = np.random.default_rng(seed)
    jobs = make_jobs(num_jobs, min(gpus, 64), data, rng)
    problem = AllocationProblem(
        start_at=datetime(2021, 1, 1, tzinfo=UTC),
        slot_s=SLOT_S,
        capacity_gpus=(gpus,) * SLOTS,
        intensity_g_per_kwh=tuple(intensity_day(data)),
        jobs=tuple(jobs),
    )
    began = time.perf_counter()
    plan = solve(problem, time_limit_s=time_limit_s, seed=seed)
    wall_s = time.perf_counter() - began
    met = sum(plan.deadline_met.values())
    lp_misses = float(plan.notes[0].split("=")[1]) if plan.notes else 0.0
    miss_cost = problem.deadline_miss_cost_s()
    misses = len(plan.deadline_met) - met
    # Gap of the completion/carbon/change terms alone, deadline misses taken out on both sides.
    rest = plan.objective - miss_cost * misses
    rest_bound = (plan.bound or 0.0) - miss_cost * lp_misses
    return {
        "jobs": num_jobs,
        "slots": SLOTS,
        "gpus": gpus,
        "solve_s": round(wall_s, 3),
        "gap": None if plan.gap is None else round(plan.gap, 5),
        "status": plan.status,
        "deadlines_met": f"{met}/{len(plan.deadline_met)}",
        "lp_deadline_misses": round(lp_misses, 2),
        "gap_without_deadline_term": round(max(0.0, rest - rest_bound) / max(rest, 1e-9), 5),
        "objective": plan.objective,
        "lp_bound": plan.bound,
    }


def main() -> None:
    """Parse options, run every case, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--cases", default="100:256,1000:256,1000:2048,5000:8192")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=10.0)
    args = parser.parse_args()
    cases = []
    for spec in args.cases.split(","):
        jobs, gpus = (int(x) for x in spec.split(":"))
        cases.append(run_case(jobs, gpus, args.data, args.seed, args.time_limit_s))
        print(json.dumps(cases[-1]), file=sys.stderr)
    print(json.dumps({"cases": cases}, indent=2))


if __name__ == "__main__":
    main()
