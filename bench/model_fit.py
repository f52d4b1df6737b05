"""Fit error of the job model on public measurements. Prints JSON.

- throughput_mape: each ElasticFlow scaling profile (A100 and T4), one GPU count held out at a
  time: fit the iteration-time model to every other cell (all batch sizes), predict the held-out
  count. Baseline: log-log interpolation between the neighbouring measured counts (or
  extrapolation from the nearest two).
- power_mape: each Zeus power trace (V100, A40, P100, RTX6000; highest power limit), one batch
  size held out at a time per workload: fit idle + dynamic * utilisation**exponent to the other
  batch sizes (utilisation = epoch-time ratio to the workload's fastest batch size, i.e. what
  telemetry reports), predict the held-out power. Baseline: mean power of the other batch sizes.
- samples_to_10pct: cold start of an unknown workload (generic prior built WITHOUT that
  workload), telemetry samples at random allowed counts with 3 % noise; how many samples until
  the fitted throughput is, and stays (up to 30 samples), within 10 % (MAPE over all counts)
  of the measured profile.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from energy_model.fit import PowerObs, PowerParams, ThroughputParams, fit_power
from energy_model.job_model import JobModelFitter, TelemetryPoint, model_from_params, prior_params
from energy_model.priors_build import fit_profile, read_zeus_power
from energy_model.profiles import ScalingProfile, load_scaling_profiles

T0 = datetime(2024, 1, 1, tzinfo=UTC)
MAX_SAMPLES = 30


def interp_baseline(row: dict[int, float], held: int) -> float:
    """Log-log interpolation of iterations/s at `held` from the other counts of one row."""
    pts = sorted((math.log2(g), math.log(v)) for g, v in row.items() if g != held)
    x = math.log2(held)
    below = [p for p in pts if p[0] < x]
    above = [p for p in pts if p[0] > x]
    if below and above:
        (x0, y0), (x1, y1) = below[-1], above[0]
    elif len(below) >= 2:
        (x0, y0), (x1, y1) = below[-2], below[-1]
    elif len(above) >= 2:
        (x0, y0), (x1, y1) = above[0], above[1]
    else:
        return math.exp(pts[0][1])
    return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def throughput_holdout(profiles: dict[str, ScalingProfile]) -> dict[str, Any]:
    """Leave-one-GPU-count-out errors per profile."""
    per_model: dict[str, dict[str, float]] = {}
    all_model, all_base = [], []
    for name, profile in profiles.items():
        counts = sorted({g for row in profile.iterations_per_s.values() for g in row})
        errs, base = [], []
        for held in counts:
            rows = {b: r for b, r in profile.iterations_per_s.items() if held in r and len(r) > 2}
            if not rows or len(counts) < 3:
                continue
            params = fit_profile(profile, skip_gpus=held)
            for b, row in rows.items():
                truth = row[held] * b
                errs.append(abs(params.samples_per_s(held, b) / truth - 1))
                base.append(abs(interp_baseline(row, held) * b / truth - 1))
        if errs:
            per_model[name] = {
                "mape_model": round(100 * statistics.fmean(errs), 2),
                "mape_interp": round(100 * statistics.fmean(base), 2),
                "cells": len(errs),
            }
            all_model += errs
            all_base += base
    return {
        "mape_model": round(100 * statistics.fmean(all_model), 2),
        "mape_interp": round(100 * statistics.fmean(all_base), 2),
        "per_profile": per_model,
    }


def power_holdout(zeus: Path) -> dict[str, Any]:
    """Leave-one-batch-size-out errors per GPU and workload."""
    out: dict[str, Any] = {}
    all_model, all_base = [], []
    for path in sorted(zeus.glob("summary_power_*.csv")):
        gpu = path.stem.removeprefix("summary_power_")
        groups = read_zeus_power(path)
        limit_w = max(p for items in groups.values() for _, p, _ in items)
        # A weak, GPU-agnostic start: idle 15 %, dynamic 60 % of the highest power seen.
        start = PowerParams(0.15 * limit_w, 0.6 * limit_w, 1.0)
        errs, base = [], []
        for items in groups.values():
            if len(items) < 3:
                continue
            for i, (u, p, _) in enumerate(items):
                rest = [x for j, x in enumerate(items) if j != i]
                params = fit_power([PowerObs(ru, rp) for ru, rp, _ in rest], start, 1.0)
                errs.append(abs(params.per_gpu_w(u) / p - 1))
                base.append(abs(statistics.fmean(rp for _, rp, _ in rest) / p - 1))
        out[gpu] = {
            "mape_model": round(100 * statistics.fmean(errs), 2),
            "mape_mean_baseline": round(100 * statistics.fmean(base), 2),
            "points": len(errs),
        }
        all_model += errs
        all_base += base
    return {
        "mape_model": round(100 * statistics.fmean(all_model), 2),
        "mape_mean_baseline": round(100 * statistics.fmean(all_base), 2),
        "per_gpu": out,
    }


def leave_one_out_generic(fits: dict[str, ThroughputParams], skip: str) -> ThroughputParams:
    """Geometric mean of the other profiles' coefficients (a prior that never saw `skip`)."""
    others = [p for n, p in fits.items() if n != skip]
    fields = ("compute_s_per_sample", "overhead_s", "allreduce_s", "latency_s")
    return ThroughputParams(
        *(math.exp(statistics.fmean(math.log(getattr(p, f)) for p in others)) for f in fields)
    )


def samples_to_10pct(profiles: dict[str, ScalingProfile], seeds: int = 5) -> dict[str, Any]:
    """Samples the online fitter needs, from a generic prior, to get within 10 % everywhere."""
    fits = {name: fit_profile(p) for name, p in profiles.items()}
    per_model: dict[str, Any] = {}
    needed_all: list[float] = []
    prior_errors: list[float] = []
    for name, profile in profiles.items():
        batch = max(profile.batch_sizes(), key=lambda b: len(profile.iterations_per_s[b]))
        truth = {g: ips * batch for g, ips in profile.iterations_per_s[batch].items()}
        counts = sorted(truth)
        if len(counts) < 3:
            continue
        generic = replace(
            prior_params("generic", batch), throughput=leave_one_out_generic(fits, name)
        )
        prior = model_from_params(generic, counts)
        prior_mape = statistics.fmean(
            abs(prior.throughput_samples_per_s[g] / truth[g] - 1) for g in counts
        )
        prior_errors.append(prior_mape)
        needed = []
        for seed in range(seeds):
            rng = random.Random(seed)
            fitter = JobModelFitter(prior, obs_rel_std=0.03)
            mapes = []
            for n in range(1, MAX_SAMPLES + 1):
                g = rng.choice(counts)
                sps = truth[g] * math.exp(rng.gauss(0, 0.03))
                model = fitter.update(
                    [TelemetryPoint(g, sps, None, T0 + timedelta(seconds=60 * n))]
                )
                mapes.append(
                    statistics.fmean(
                        abs(model.throughput_samples_per_s[c] / truth[c] - 1) for c in counts
                    )
                )
            # The first sample count after which the fit stays within 10 %.
            hit = None
            for n in range(MAX_SAMPLES, 0, -1):
                if mapes[n - 1] > 0.10:
                    break
                hit = n
            needed.append(float(hit) if hit is not None else math.inf)
        per_model[name] = {
            "batch": batch,
            "prior_mape": round(100 * prior_mape, 1),
            "samples": needed,
        }
        needed_all += needed
    finite = [n for n in needed_all if math.isfinite(n)]
    return {
        "median": statistics.median(needed_all),
        "mean_when_reached": round(statistics.fmean(finite), 2) if finite else None,
        "never_within_max": sum(1 for n in needed_all if not math.isfinite(n)),
        "runs": len(needed_all),
        "generic_prior_mape": round(100 * statistics.fmean(prior_errors), 1),
        "per_profile": per_model,
    }


def main() -> None:
    """Run the benchmark and print JSON."""
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=default)
    args = parser.parse_args()
    ef = args.data / "elasticflow"
    if not ef.is_dir():
        print(f"no ElasticFlow data under {ef}", file=sys.stderr)
        sys.exit(2)
    profiles = {
        f"{gpu}/{name}": p
        for gpu in ("A100", "T4")
        for name, p in load_scaling_profiles(ef / f"throughputs_{gpu}").items()
    }
    tput = throughput_holdout(profiles)
    power = power_holdout(args.data / "zeus")
    samples = samples_to_10pct(load_scaling_profiles(ef / "throughputs_A100"))
    result = {
        "throughput_mape": tput["mape_model"],
        "power_mape": power["mape_model"],
        "samples_to_10pct": samples["median"],
        "detail": {"throughput": tput, "power": power, "samples_to_10pct": samples},
    }
    print(json.dumps(result, indent=2, default=_json_default))


def _json_default(value: object) -> object:
    if isinstance(value, float) and math.isinf(value):
        return None
    return str(value)


if __name__ == "__main__":
    main()
