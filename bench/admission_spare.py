"""Admission's incremental check alone: `admit_on_spare` against a plan holding N deadline jobs
(JSON out; pure CPU, no database).

Per size: N deadline jobs of 1-4 GPUs, each held by the plan in force at one GPU half of every
12 h over a one-day horizon of 300 s slots (288 slots), on a cluster of N GPUs; a new deadline job
(6 h, up to 4 GPUs) is checked `--repeat` times against the same plan (the service builds the
plan's rows once per plan in force). Prints `{"sizes": [{"held_deadline_jobs", "slots",
"check_s", "admitted"}]}`.

Usage:
    python -m bench.admission_spare [--sizes 100,1000,5000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import UTC, datetime

from scheduler_service.allocation.admission import HeldGpus, admit_on_spare
from scheduler_service.allocation.problem import AllocationProblem, JobSpec

SLOT_S = 300.0
SLOTS = 288
START = datetime(2026, 6, 1, tzinfo=UTC)


def _job(job_id: str, deadline_s: float, samples: float) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        allowed_gpus=(1, 2, 4),
        throughput_samples_per_s=(10.0, 19.0, 36.0),
        power_w=(300.0, 600.0, 1200.0),
        remaining_samples=samples,
        deadline_s=deadline_s,
    )


def measure(held_jobs: int, repeat: int) -> dict[str, object]:
    """Seconds per check with `held_jobs` deadline jobs in the plan in force."""
    jobs = tuple(_job(str(i), 20 * 3600.0, 360_000.0) for i in range(held_jobs))
    # Staggered: each job runs 12 of every 24 slots (its own phase), so the GPUs are half used.
    rows = {
        str(i): tuple(1 if (t + i) % 24 < 12 else 0 for t in range(SLOTS)) for i in range(held_jobs)
    }
    problem = AllocationProblem(
        start_at=START,
        slot_s=SLOT_S,
        capacity_gpus=(held_jobs,) * SLOTS,
        intensity_g_per_kwh=(100.0,) * SLOTS,
        jobs=jobs,
    )
    plan = HeldGpus(START, SLOT_S, rows)
    new = _job("new", 6 * 3600.0, 100_000.0)
    admit_on_spare(problem, new, plan)  # the plan's rows are built once, as per plan in force
    began = time.perf_counter()
    for _ in range(repeat):
        result = admit_on_spare(problem, new, plan)
    return {
        "held_deadline_jobs": held_jobs,
        "slots": SLOTS,
        "check_s": round((time.perf_counter() - began) / repeat, 4),
        "admitted": result is not None and result[0].admitted,
    }


def main() -> None:
    """Run the sizes and print the JSON figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,5000")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    sizes = [measure(int(n), args.repeat) for n in args.sizes.split(",") if n]
    report = {"sizes": sizes, "setup": {"load_1min": round(os.getloadavg()[0], 2)}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
