"""Schedule quality: every policy on the same trace slice and carbon series (JSON out).

Replays the first --jobs jobs of an ElasticFlow ITP trace on each carbon series, for every
policy with an unlimited budget, GreenFlow at a few carbon prices, and GreenFlow and the
carbon-agnostic baseline both capped to the same hard budget (a share of the carbon-agnostic
run's emissions, split per day). Prints
  {"policies": {NAME: {deadline_met_ratio, avg_jct_s, p95_jct_s, energy_kwh, emissions_kg,
   gpu_changes, ...}}, "by_series": {...}, "targets": {...}}
where "policies" sums energy/emissions/changes over the series and averages the ratios/JCTs.
Usage:
    python bench/schedule_quality.py [--data DIR] [--jobs 150] [--cluster 2x8]
        [--series US-CAL-CISO_2021,ES_2021] [--prices 2000,20000] [--budget-share 0.5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from energy_model.carbon.series import IntensitySeries, load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.simulate.engine import SimulationConfig, SimulationReport, simulate_trace
from scheduler_service.simulate.trace import load_trace

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
BASELINES = ("carbon-agnostic", "static", "carbon-greedy", "shift", "greenflow")


def figures(report: SimulationReport, wall_s: float) -> dict[str, Any]:
    """The per-run figures the bench reports."""
    return {
        "deadline_met_ratio": round(report.deadline_met_ratio, 4),
        "avg_jct_s": None if report.avg_jct_s is None else round(report.avg_jct_s, 1),
        "p95_jct_s": None if report.p95_jct_s is None else round(report.p95_jct_s, 1),
        "energy_kwh": round(report.energy_kwh, 3),
        "emissions_kg": round(report.emissions_kg, 4),
        "gpu_changes": report.gpu_changes,
        "finished": report.finished,
        "admitted": report.admitted,
        "jobs": report.jobs,
        "budget_kg": report.budget_kg,
        "budget_violations": report.budget_violations,
        "solver_s_mean": round(report.solver_s_mean, 4),
        "wall_s": round(wall_s, 1),
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum energy/emissions/changes over series; average ratios and JCTs."""

    def mean(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return round(statistics.fmean(values), 4) if values else None

    return {
        "deadline_met_ratio": mean("deadline_met_ratio"),
        "avg_jct_s": mean("avg_jct_s"),
        "p95_jct_s": mean("p95_jct_s"),
        "energy_kwh": round(sum(r["energy_kwh"] for r in runs), 3),
        "emissions_kg": round(sum(r["emissions_kg"] for r in runs), 4),
        "gpu_changes": sum(r["gpu_changes"] for r in runs),
        "finished": sum(r["finished"] for r in runs),
    }


def main() -> None:
    """Run every policy on every series, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--trace", default="cluster01")
    parser.add_argument("--jobs", type=int, default=150)
    parser.add_argument("--cluster", default="2x8")
    parser.add_argument("--series", default="US-CAL-CISO_2021,ES_2021")
    parser.add_argument("--prices", default="2000,20000")
    parser.add_argument("--budget-share", type=float, default=0.5)
    parser.add_argument("--slot-s", type=float, default=900.0)
    parser.add_argument("--time-limit-s", type=float, default=1.0)
    args = parser.parse_args()
    ef = args.data / "elasticflow"
    if not ef.is_dir():
        sys.exit(f"benchmark data not found at {args.data} (use --data DIR)")
    jobs = load_trace(ef / "itp" / f"{args.trace}.csv", limit=args.jobs)
    profiles = load_scaling_profiles(ef / "throughputs_A100")
    nodes, per_node = (int(x) for x in args.cluster.lower().split("x"))
    prices = [float(p) for p in args.prices.split(",") if p]
    by_series: dict[str, dict[str, Any]] = {}
    for name in args.series.split(","):
        series = load_intensity_csv(args.data / "carbon" / "electricitymaps" / f"{name}_hourly.csv")

        def run(
            policy: str, series: IntensitySeries = series, **extra: Any
        ) -> tuple[SimulationReport, float]:
            config = SimulationConfig(
                policy=policy,
                num_nodes=nodes,
                gpus_per_node=per_node,
                slot_s=args.slot_s,
                time_limit_s=args.time_limit_s,
                **extra,
            )
            began = time.perf_counter()
            report = simulate_trace(jobs, series, profiles, config)
            return report, time.perf_counter() - began

        results: dict[str, dict[str, Any]] = {}
        reports: dict[str, SimulationReport] = {}
        for policy in BASELINES:
            reports[policy], wall = run(policy)
            results[policy] = figures(reports[policy], wall)
            print(f"{name} {policy}: {json.dumps(results[policy])}", file=sys.stderr)
        for price in prices:
            key = f"greenflow-price-{price:g}"
            reports[key], wall = run("greenflow", carbon_price_s_per_kg=price)
            results[key] = figures(reports[key], wall)
            print(f"{name} {key}: {json.dumps(results[key])}", file=sys.stderr)
        budget_kg = reports["carbon-agnostic"].emissions_kg * args.budget_share
        for policy in ("carbon-agnostic", "greenflow"):
            key = f"{policy}-capped"
            reports[key], wall = run(policy, budget_kg=budget_kg, budget_period="day")
            results[key] = figures(reports[key], wall)
            print(f"{name} {key}: {json.dumps(results[key])}", file=sys.stderr)
        by_series[name] = results

    names = list(next(iter(by_series.values())))
    policies = {n: aggregate([by_series[s][n] for s in by_series]) for n in names}
    targets: dict[str, Any] = {}
    for s, results in by_series.items():
        ca, gf_cap, ca_cap = (
            results["carbon-agnostic"],
            results["greenflow-capped"],
            results["carbon-agnostic-capped"],
        )
        # Same-deadline comparison: the cleanest GreenFlow run that meets at least as many.
        same_dl = [
            (k, r)
            for k, r in results.items()
            if k.startswith("greenflow")
            and not k.endswith("capped")
            and r["deadline_met_ratio"] >= ca["deadline_met_ratio"]
        ]
        best = min(same_dl, key=lambda kr: kr[1]["emissions_kg"]) if same_dl else None
        targets[s] = {
            "jct_speedup_at_same_budget": (
                round(ca_cap["avg_jct_s"] / gf_cap["avg_jct_s"], 3)
                if ca_cap["avg_jct_s"] and gf_cap["avg_jct_s"]
                else None
            ),
            "finished_at_same_budget": {
                "greenflow": gf_cap["finished"],
                "carbon-agnostic": ca_cap["finished"],
            },
            "carbon_saving_at_same_deadline_ratio": (
                round(1 - best[1]["emissions_kg"] / ca["emissions_kg"], 4) if best else None
            ),
            "run_used": best[0] if best else None,
        }
    print(json.dumps({"policies": policies, "by_series": by_series, "targets": targets}, indent=2))


if __name__ == "__main__":
    main()
