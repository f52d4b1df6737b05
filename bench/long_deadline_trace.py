"""A seeded synthetic trace of long jobs with multi-day deadlines, from the shared T4 profiles.

The public ITP traces give every job a deadline 0.5-1.5 x its original run time after its
submission, so few deadlines lie more than a planning horizon away. This trace stresses the
promise admission makes for far deadlines (issue 23): a share of the jobs run for many hours
at the GPUs they ask for, and their deadlines lie one to three days after their submission.

Each job: a model of ../shared/data/elasticflow/throughputs_T4 and one of its measured global
batch sizes; the GPUs it asks for, a measured count of that row; a run time at that count
(log-uniform, hours for long jobs, minutes to a few hours for the rest) that sets its
iterations; a deadline `slack x run time` after its submission, the slack drawn so long jobs'
deadlines lie 1-3 days away; Poisson arrivals over `--span-h`. Writes the ElasticFlow CSV
`greenflow simulate --jobs` reads (`--profiles .../throughputs_T4`).

Usage:
    python -m bench.long_deadline_trace [--data DIR] [--jobs 60] [--seed 0] [--span-h 48]
        [--long-share 0.4] [--max-gpus 16] --out trace.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from pathlib import Path

from energy_model.profiles import ScalingProfile, load_scaling_profiles
from scheduler_service.simulate.trace import TRACE_COLUMNS, TraceJob

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# Run time at the requested GPUs (h): long jobs, and the rest.
LONG_RUN_H = (6.0, 30.0)
SHORT_RUN_H = (0.1, 3.0)
# Deadline windows of long jobs lie this many days after submission (the slack is drawn so).
LONG_WINDOW_DAYS = (1.0, 3.0)
# The rest get ElasticFlow-like slack on their run time, a little roomier (never under 1).
SHORT_SLACK = (1.1, 2.0)


def _useful_counts(profile: ScalingProfile, batch: int, max_gpus: int) -> list[int]:
    """Measured GPU counts up to `max_gpus` faster than every smaller one (the simulator drops
    the others), or the smallest measured count when none fits."""
    row = profile.iterations_per_s[batch]
    useful: list[int] = []
    for g in sorted(row):
        if not useful or row[g] > row[useful[-1]]:
            useful.append(g)
    return [g for g in useful if g <= max_gpus] or useful[:1]


def generate(
    profiles: dict[str, ScalingProfile],
    jobs: int,
    seed: int = 0,
    span_h: float = 48.0,
    long_share: float = 0.4,
    max_gpus: int = 16,
) -> list[TraceJob]:
    """`jobs` synthetic trace jobs (seeded): see the module docstring for the distributions."""
    if jobs < 1 or span_h <= 0 or not 0.0 <= long_share <= 1.0 or max_gpus < 1:
        raise ValueError("need jobs >= 1, span_h > 0, 0 <= long_share <= 1 and max_gpus >= 1")
    rng = random.Random(seed)
    models = sorted(profiles)
    if not models:
        raise ValueError("no scaling profiles")
    mean_gap_s = span_h * 3600.0 / jobs
    now_s = 0.0
    out: list[TraceJob] = []
    for index in range(jobs):
        model = rng.choice(models)
        profile = profiles[model]
        batch = rng.choice(profile.batch_sizes())
        gpus = rng.choice(_useful_counts(profile, batch, max_gpus))
        long = rng.random() < long_share
        low_h, high_h = LONG_RUN_H if long else SHORT_RUN_H
        run_s = 3600.0 * math.exp(rng.uniform(math.log(low_h), math.log(high_h)))
        iterations = max(1, round(run_s * profile.iterations_per_s[batch][gpus]))
        if long:
            window_s = 86_400.0 * rng.uniform(*LONG_WINDOW_DAYS)
            window_s = max(window_s, 1.1 * run_s)
        else:
            window_s = rng.uniform(*SHORT_SLACK) * run_s
        out.append(
            TraceJob(
                job_id=f"syn{index:04d}",
                submission_s=round(now_s, 3),
                num_iteration=iterations,
                model_name=model,
                deadline_s=round(now_s + window_s, 3),
                batch_size=batch,
                num_gpu=gpus,
                duration_s=round(run_s, 3),
            )
        )
        now_s += rng.expovariate(1.0 / mean_gap_s)
    return out


def write_trace_csv(jobs: list[TraceJob], path: Path) -> None:
    """Write `jobs` in the ElasticFlow CSV format `load_trace` reads."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TRACE_COLUMNS)
        for j in jobs:
            writer.writerow(
                [
                    j.job_id,
                    j.submission_s,
                    j.num_iteration,
                    j.model_name,
                    "" if j.deadline_s is None else j.deadline_s,
                    j.batch_size,
                    j.num_gpu,
                    j.duration_s,
                ]
            )


def main(argv: list[str] | None = None) -> int:
    """Write one synthetic trace (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--span-h", type=float, default=48.0)
    parser.add_argument("--long-share", type=float, default=0.4)
    parser.add_argument("--max-gpus", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    folder = args.data / "elasticflow" / "throughputs_T4"
    if not folder.is_dir():
        print(f"no T4 profiles at {folder}: pass --data (the shared data folder)", file=sys.stderr)
        return 2
    trace = generate(
        load_scaling_profiles(folder),
        args.jobs,
        seed=args.seed,
        span_h=args.span_h,
        long_share=args.long_share,
        max_gpus=args.max_gpus,
    )
    write_trace_csv(trace, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
