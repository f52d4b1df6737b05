"""Schedule quality: every policy on the same trace slice and carbon series (JSON out).

Two scenarios per carbon series, on the first --jobs jobs of an ElasticFlow ITP trace:
- "deadlines" (ElasticFlow semantics, unlimited budget): every policy, plus GreenFlow at each
  carbon price; a deadline job counts as met only if admitted and finished by its deadline.
- "budget" (every job finishes): deadline jobs that admission cannot guarantee run best-effort
  instead of being rejected, and the replay goes on until all are done (the carbon series wraps,
  each further day gets the same budget share), so average JCT is over all jobs and nobody is
  dropped to look fast. The carbon-agnostic baseline and GreenFlow are both capped to the same
  per-day hard budget: --budget-share x the uncapped best-effort carbon-agnostic run's emissions.
Prints {"policies": {NAME: {deadline_met_ratio, avg_jct_s, p95_jct_s, energy_kwh, emissions_kg,
gpu_changes, ...}}, "by_series": {...}, "targets": {...}, "settings": {...}}; "policies" sums
energy/emissions/changes over the series and averages ratios and JCTs; "targets" states each
target of issue 4, the figure per series and whether it is met on every series; for the carbon
target it also prints, per series, an upper bound on the saving any policy meeting the deadlines
carbon-agnostic meets could reach (carbon_saving_bound), and for the JCT target a lower bound on
the average JCT any policy can reach under the same per-day budget
(scheduler_service.simulate.bounds, and its Lagrangian with exact completion times,
scheduler_service.simulate.lagrangian_bound; the higher is used) with the most speed-up over capped carbon-agnostic it allows,
so a miss can be told from a limit.
Usage:
    python bench/schedule_quality.py [--data DIR] [--jobs 100] [--cluster 2x8]
        [--series US-CAL-CISO_2021,ES_2021] [--prices 200000] [--budget-share 0.5] [--horizon-slots 96]
        [--lagrangian-iterations 400]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from energy_model.carbon.series import IntensitySeries, load_intensity_csv
from energy_model.profiles import ScalingProfile, load_scaling_profiles
from scheduler_service.simulate.bounds import JctBound, avg_jct_lower_bound
from scheduler_service.simulate.engine import (
    CarbonClock,
    SimulationConfig,
    SimulationReport,
    simulate_trace,
)
from scheduler_service.simulate.lagrangian_bound import (
    LagrangianBound,
    avg_jct_lagrangian_bound,
)
from scheduler_service.simulate.trace import TraceJob, job_tables, load_trace

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
BASELINES = ("carbon-agnostic", "static", "carbon-greedy", "shift", "greenflow")
JCT_SPEEDUP_TARGET = 2.0
CARBON_SAVING_TARGET = 0.40
# Emissions within this share of the capped baseline's count as "the same emissions".
SAME_EMISSIONS_TOLERANCE = 0.01


def figures(report: SimulationReport, wall_s: float) -> dict[str, Any]:
    """The per-run figures the bench reports."""
    return {
        "deadline_met_ratio": round(report.deadline_met_ratio, 4),
        # All admitted jobs; one left unfinished counts until the replay's end.
        "avg_jct_s": None if report.avg_jct_all_s is None else round(report.avg_jct_all_s, 1),
        "avg_jct_finished_s": None if report.avg_jct_s is None else round(report.avg_jct_s, 1),
        "p95_jct_s": None if report.p95_jct_s is None else round(report.p95_jct_s, 1),
        "energy_kwh": round(report.energy_kwh, 3),
        "emissions_kg": round(report.emissions_kg, 4),
        "gpu_changes": report.gpu_changes,
        "finished": report.finished,
        "unfinished": report.unfinished,
        "admitted": report.admitted,
        "jobs": report.jobs,
        "deadline_jobs": report.deadline_jobs,
        "budget_kg": report.budget_kg,
        "budget_violations": report.budget_violations,
        "solver_s_mean": round(report.solver_s_mean, 4),
        "wall_s": round(wall_s, 1),
    }


def least_kg_per_job(
    jobs: list[TraceJob],
    series: IntensitySeries,
    profiles: dict[str, ScalingProfile],
    capacity_gpus: int,
) -> dict[str, float]:
    """Per deadline job that can meet its deadline alone: the least kg any policy can meet it with.

    Its work at the allowed count with the fewest joules per sample among those that finish
    within the deadline window, all of it at the cleanest hour's intensity inside the window
    (contention ignored). Jobs no count can finish in time are left out (nobody meets them).
    """
    clock = CarbonClock(series, pue=1.0)
    out = {}
    for job in jobs:
        if job.deadline_s is None:
            continue
        window_s = job.deadline_s - job.submission_s
        tables = job_tables(job, profiles, capacity_gpus)
        joules = [
            power / rate
            for rate, power in zip(tables.throughput_samples_per_s, tables.power_w, strict=True)
            if job.total_samples / rate <= window_s
        ]
        if not joules:
            continue
        # The series is hourly steps: the cleanest piece of the window between hour marks.
        marks = [job.submission_s]
        hour = (job.submission_s // 3600 + 1) * 3600
        while hour < job.deadline_s:
            marks.append(hour)
            hour += 3600
        marks.append(job.deadline_s)
        cleanest = min(clock.mean_intensity(a, b) for a, b in itertools.pairwise(marks) if b > a)
        out[job.job_id] = job.total_samples * min(joules) / 3.6e6 * cleanest / 1000.0
    return out


def carbon_saving_bound(
    least_kg: dict[str, float], met_ids: list[str], reference_kg: float
) -> float | None:
    """Most carbon a policy meeting the same deadlines as the reference can save against it.

    Meeting those jobs' deadlines costs at least their least kg (least_kg_per_job), so
    1 - that / reference_kg bounds the saving from above (contention only makes it worse).
    """
    if reference_kg <= 0:
        return None
    return round(1.0 - sum(least_kg.get(j, 0.0) for j in met_ids) / reference_kg, 4)


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
        "unfinished": sum(r["unfinished"] for r in runs),
    }


def series_targets(
    results: dict[str, dict[str, Any]],
    least_kg: dict[str, float],
    ca_met_ids: list[str],
    jct_bound: JctBound,
    lagrangian: LagrangianBound | None = None,
) -> dict[str, Any]:
    """Both targets of issue 4 on one series' runs (`least_kg`: least_kg_per_job; `ca_met_ids`:
    the jobs whose deadline carbon-agnostic meets; `jct_bound`, `lagrangian`: the capped runs'
    JCT bounds, fluid LP and Lagrangian; the higher one is used)."""
    ca = results["carbon-agnostic"]
    ca_cap, gf_cap = results["carbon-agnostic-capped"], results["greenflow-capped"]
    speedup = None
    if ca_cap["avg_jct_s"] and gf_cap["avg_jct_s"]:
        speedup = round(ca_cap["avg_jct_s"] / gf_cap["avg_jct_s"], 3)
    same_emissions = gf_cap["emissions_kg"] <= ca_cap["emissions_kg"] * (
        1 + SAME_EMISSIONS_TOLERANCE
    )
    all_finished = gf_cap["unfinished"] == 0 and ca_cap["unfinished"] == 0
    # Same deadline ratio: the cleanest GreenFlow run that meets at least as many deadlines.
    same_dl = [
        (k, r)
        for k, r in results.items()
        if k.startswith("greenflow")
        and not k.endswith("capped")
        and r["deadline_met_ratio"] >= ca["deadline_met_ratio"]
    ]
    best = min(same_dl, key=lambda kr: kr[1]["emissions_kg"]) if same_dl else None
    saving = round(1 - best[1]["emissions_kg"] / ca["emissions_kg"], 4) if best else None
    # No policy within the same per-day budget has a lower average JCT than the bound.
    lower_bound_s = max(jct_bound.avg_jct_s, lagrangian.avg_jct_s if lagrangian else 0.0)
    max_speedup = None
    if ca_cap["avg_jct_s"] and lower_bound_s > 0:
        max_speedup = round(ca_cap["avg_jct_s"] / lower_bound_s, 3)
    return {
        "jct_speedup_at_same_budget": speedup,
        "jct_avg_lower_bound_s": round(lower_bound_s, 1),
        "jct_bound_lagrangian": None
        if lagrangian is None
        else {
            "avg_jct_s": round(lagrangian.avg_jct_s, 1),
            "at_lp_duals_avg_jct_s": round(lagrangian.first_avg_jct_s, 1),
            "iterations": lagrangian.iterations,
            "solve_s": round(lagrangian.solve_s, 1),
        },
        "jct_speedup_upper_bound": max_speedup,
        "jct_bound_lp": {
            "lp_avg_jct_s": round(jct_bound.lp_avg_jct_s, 1),
            "tail_work": jct_bound.tail_work,
            "horizon_end_s": round(jct_bound.horizon_s),
            "slots": jct_bound.slots,
            "variables": jct_bound.variables,
            "solve_s": round(jct_bound.solve_s, 1),
        },
        "jct_emissions_kg": {
            "greenflow": gf_cap["emissions_kg"],
            "carbon-agnostic": ca_cap["emissions_kg"],
        },
        "jct_same_emissions": same_emissions,
        "jct_all_jobs_finished": all_finished,
        "jct_met": bool(
            speedup is not None
            and speedup >= JCT_SPEEDUP_TARGET
            and same_emissions
            and all_finished
        ),
        "carbon_saving_at_same_deadline_ratio": saving,
        "carbon_run_used": best[0] if best else None,
        "deadline_met_ratio": {
            "greenflow": best[1]["deadline_met_ratio"] if best else None,
            "carbon-agnostic": ca["deadline_met_ratio"],
        },
        "carbon_met": bool(saving is not None and saving >= CARBON_SAVING_TARGET),
        # No policy meeting as many deadlines can save more than this (see carbon_saving_bound).
        "carbon_saving_upper_bound": carbon_saving_bound(least_kg, ca_met_ids, ca["emissions_kg"]),
    }


def main() -> None:
    """Run every policy on every series, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--trace", default="cluster01")
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--cluster", default="2x8")
    parser.add_argument("--series", default="US-CAL-CISO_2021,ES_2021")
    parser.add_argument("--prices", default="200000")
    parser.add_argument("--budget-share", type=float, default=0.5)
    parser.add_argument("--slot-s", type=float, default=900.0)
    # 96 x 900 s = 24 h: the planner sees a whole daily budget period (with 48 slots it saw half
    # a day and spent the day's budget without knowing the cleaner hours after; measured 1.25x
    # vs 1.44x JCT against the capped baseline on CAISO).
    parser.add_argument("--horizon-slots", type=int, default=96)
    parser.add_argument("--time-limit-s", type=float, default=0.5)
    # Rounds of the Lagrangian JCT bound (scheduler_service/simulate/lagrangian_bound.py; about
    # 140 s per series at 400); 0 leaves only the fluid LP's bound.
    parser.add_argument("--lagrangian-iterations", type=int, default=400)
    args = parser.parse_args()
    if args.lagrangian_iterations < 0:
        parser.error("--lagrangian-iterations must be >= 0")
    ef = args.data / "elasticflow"
    if not ef.is_dir():
        sys.exit(f"benchmark data not found at {args.data} (use --data DIR)")
    jobs = load_trace(ef / "itp" / f"{args.trace}.csv", limit=args.jobs)
    profiles = load_scaling_profiles(ef / "throughputs_A100")
    nodes, per_node = (int(x) for x in args.cluster.lower().split("x"))
    prices = [float(p) for p in args.prices.split(",") if p]
    by_series: dict[str, dict[str, Any]] = {}
    least_kg: dict[str, dict[str, float]] = {}
    jct_bounds: dict[str, JctBound] = {}
    lagrangian: dict[str, LagrangianBound] = {}
    ca_met: dict[str, list[str]] = {}

    def config_for(policy: str, **extra: Any) -> SimulationConfig:
        """The bench's cluster, slot, horizon and time limit, plus the run's own settings."""
        return SimulationConfig(
            policy=policy,
            num_nodes=nodes,
            gpus_per_node=per_node,
            slot_s=args.slot_s,
            horizon_slots=args.horizon_slots,
            time_limit_s=args.time_limit_s,
            **extra,
        )

    for name in args.series.split(","):
        series = load_intensity_csv(args.data / "carbon" / "electricitymaps" / f"{name}_hourly.csv")
        results: dict[str, dict[str, Any]] = {}

        def run(
            key: str,
            policy: str,
            *,
            series: IntensitySeries = series,
            results: dict[str, dict[str, Any]] = results,
            name: str = name,
            **extra: Any,
        ) -> SimulationReport:
            config = config_for(policy, **extra)
            began = time.perf_counter()
            report = simulate_trace(jobs, series, profiles, config)
            results[key] = figures(report, time.perf_counter() - began)
            print(f"{name} {key}: {json.dumps(results[key])}", file=sys.stderr)
            return report

        for policy in BASELINES:
            report = run(policy, policy)
            if policy == "carbon-agnostic":
                ca_met[name] = [o.job_id for o in report.outcomes if o.deadline_met]
        for price in prices:
            run(f"greenflow-price-{price:g}", "greenflow", carbon_price_s_per_kg=price)
        reference = run("carbon-agnostic-best-effort", "carbon-agnostic", best_effort=True)
        capped: dict[str, Any] = {
            "best_effort": True,
            "budget_kg": reference.emissions_kg * args.budget_share,
            "budget_period": "day",
        }
        for policy in ("carbon-agnostic", "greenflow"):
            run(f"{policy}-capped", policy, **capped)
        # Every job, the capped runs' budget and cluster (the policy name plays no part).
        bound_config = config_for("carbon-agnostic", **capped)
        jct_bounds[name] = avg_jct_lower_bound(jobs, series, profiles, bound_config)
        print(f"{name} jct bound: {jct_bounds[name]}", file=sys.stderr)
        if args.lagrangian_iterations > 0:
            lagrangian[name] = avg_jct_lagrangian_bound(
                jobs,
                series,
                profiles,
                bound_config,
                horizon_s=jct_bounds[name].horizon_s,
                iterations=args.lagrangian_iterations,
                fine_s=10.0,
            )
            print(f"{name} lagrangian jct bound: {lagrangian[name]}", file=sys.stderr)
        by_series[name] = results
        least_kg[name] = least_kg_per_job(jobs, series, profiles, nodes * per_node)

    names = list(next(iter(by_series.values())))
    policies = {n: aggregate([by_series[s][n] for s in by_series]) for n in names}
    per_series = {
        s: series_targets(results, least_kg[s], ca_met[s], jct_bounds[s], lagrangian.get(s))
        for s, results in by_series.items()
    }
    targets = {
        "jct_2x_at_same_emissions": {
            "target": (
                f"average JCT (all jobs, every job finishes) of carbon-agnostic capped to a "
                f"per-day budget of {args.budget_share:g} x its uncapped emissions, divided by "
                f"GreenFlow's under the same budget: >= {JCT_SPEEDUP_TARGET:g}"
            ),
            "figure": {s: t["jct_speedup_at_same_budget"] for s, t in per_series.items()},
            # Most speed-up any policy within the same per-day budget could show: capped
            # carbon-agnostic's avg JCT / a lower bound on every schedule's (the higher of the
            # fluid LP over the run, scheduler_service/simulate/bounds.py, and its Lagrangian
            # with exact completion times, lagrangian_bound.py): below 2 the target is out of
            # reach here for any scheduler.
            "upper_bound": {s: t["jct_speedup_upper_bound"] for s, t in per_series.items()},
            "met": all(t["jct_met"] for t in per_series.values()),
        },
        "carbon_40pct_at_same_deadline_ratio": {
            "target": (
                "1 - emissions of the cleanest GreenFlow run (any carbon price) meeting at least "
                "carbon-agnostic's deadline-met ratio / carbon-agnostic's emissions: "
                f">= {CARBON_SAVING_TARGET:g}"
            ),
            "figure": {s: t["carbon_saving_at_same_deadline_ratio"] for s, t in per_series.items()},
            # Upper bound on the saving of a policy that meets the deadlines carbon-agnostic meets
            # on this trace and series (each of those jobs alone at its least-energy count that
            # still meets its deadline, all in the cleanest hour of its window; contention
            # ignored): below 0.40 the target is out of reach here for any such scheduler.
            "upper_bound": {s: t["carbon_saving_upper_bound"] for s, t in per_series.items()},
            "met": all(t["carbon_met"] for t in per_series.values()),
        },
        "by_series": per_series,
    }
    settings = {
        "trace": args.trace,
        "jobs": len(jobs),
        "cluster": args.cluster,
        "series": args.series.split(","),
        "slot_s": args.slot_s,
        "horizon_slots": args.horizon_slots,
        "prices_s_per_kg": prices,
        "budget_share": args.budget_share,
        "budget_period": "day",
        "avg_jct_s": "all admitted jobs; unfinished ones count until the replay's end",
    }
    print(
        json.dumps(
            {
                "policies": policies,
                "targets": targets,
                "by_series": by_series,
                "settings": settings,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
