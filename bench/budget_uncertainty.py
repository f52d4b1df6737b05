"""How often a hard carbon budget is overspent when the forecast is wrong: point vs quantile plans.

The trace simulator replays the first --jobs jobs of an ElasticFlow ITP trace on a carbon series
under a daily hard budget (--budget-share x the uncapped error-free run's emissions, split per
day as `greenflow simulate --budget-period day` does), with forecast noise. `--watchdog off` (default): **no budget
watchdog** (`SimulationConfig.ideal_watchdog = False`), a step runs as planned whatever it
spends, so the budget holds only as far as the plans keep it; `--watchdog realistic`: the
service's budget watchdog as it runs (`WatchdogModel()`: checks, telemetry lag, a tick's
latency), the service as deployed. Each seed runs once planning with the noisy forecast itself
("point") and once per --quantiles value planning the budget with that quantile of the intensity
per slot (the service's rule: `planning.py`, from the forecaster's measured error; here from the
noise's own spread, `engine.forecast_upper_factor`), the forecast part of the slot about to run
with --commit-quantile (default 0.999, the service's `budget.commit_quantile`: that step's spend
is committed before the next plan can correct it; 0.5 turns it off).

Noise (`SimulationConfig.forecast_noise`, the same trace hour getting the same error however often
it is forecast): "measured" (default), ln(actual / forecast) normal with our forecaster's measured
spread at the slot's horizon hour (2.5 % at 1 h to 11.7 % at 24 h) times each --errors value
(1 = as measured on the eight series of bench/forecast_error.py); "flat", forecast = actual x
(1 + e Z) at every horizon, e = each --errors value (e.g. 0.2). The hour running now is
measured, as the service's provider reports the intensity now, unless --noisy-now (the noise on
that hour too: the model behind the earlier figures).

Prints JSON (and writes it to --out): per forecast error and plan, the runs that overspent a day,
the overspent days, the overshoot in kg and as a share of the run's allowance (every day the
replay reached) and of one day's budget, average JCT, emissions and the share of the allowance
spent (what the safety margin costs), plus every run.

Usage:
    python -m bench.budget_uncertainty [--data DIR] [--jobs 12] [--trace cluster01]
        [--series ES_2021] [--cluster 1x8] [--budget-share 0.5] [--noise measured|flat]
        [--errors 1,2]
        [--quantiles 0.8,0.9] [--commit-quantile 0.999] [--noisy-now] [--watchdog off|realistic]
        [--no-point] [--seeds 0,1,2,3] [--model-error 0] [--time-limit-s 0.5]
        [--out budget_uncertainty.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.simulate.engine import (
    SimulationConfig,
    SimulationReport,
    WatchdogModel,
    forecast_upper_factor,
    simulate_trace,
)
from scheduler_service.simulate.trace import load_trace

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
POINT = "point"


def run_summary(report: SimulationReport) -> dict[str, Any]:
    """What one run says about the budget and its price."""
    allowance = report.budget_allowance_kg or 0.0
    day_kg = report.budget_kg or 0.0
    return {
        "violations": report.budget_violations,
        "overshoot_kg": report.budget_overshoot_kg,
        "overshoot_pct_of_allowance": 100.0 * report.budget_overshoot_kg / allowance
        if allowance > 0
        else 0.0,
        "overshoot_pct_of_day_budget": 100.0 * report.budget_overshoot_kg / day_kg
        if day_kg > 0
        else 0.0,
        "allowance_kg": allowance,
        "emissions_kg": report.emissions_kg,
        "allowance_spent_share": report.emissions_kg / allowance if allowance > 0 else 0.0,
        "avg_jct_s": report.avg_jct_s,
        "finished": report.finished,
        "unfinished": report.unfinished,
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per plan: how often and by how much the budget was overspent, and at what price."""
    over = [r for r in runs if r["violations"] > 0]
    return {
        "runs": len(runs),
        "runs_over_budget": len(over),
        "days_over_budget": sum(r["violations"] for r in runs),
        "max_overshoot_kg": max((r["overshoot_kg"] for r in runs), default=0.0),
        "max_overshoot_pct_of_allowance": max(
            (r["overshoot_pct_of_allowance"] for r in runs), default=0.0
        ),
        "max_overshoot_pct_of_day_budget": max(
            (r["overshoot_pct_of_day_budget"] for r in runs), default=0.0
        ),
        "mean_avg_jct_s": statistics.fmean(r["avg_jct_s"] for r in runs),
        "mean_emissions_kg": statistics.fmean(r["emissions_kg"] for r in runs),
        "mean_allowance_spent_share": statistics.fmean(r["allowance_spent_share"] for r in runs),
        "unfinished": sum(r["unfinished"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the bench; print and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--trace", default="cluster01")
    parser.add_argument("--series", default="ES_2021")
    parser.add_argument("--cluster", default="1x8")
    parser.add_argument("--budget-share", type=float, default=0.5)
    parser.add_argument("--noise", choices=("flat", "measured"), default="measured")
    parser.add_argument("--errors", default="1,2")
    parser.add_argument("--quantiles", default="0.8,0.9")
    parser.add_argument("--commit-quantile", type=float, default=0.999)
    parser.add_argument("--noisy-now", action="store_true")
    parser.add_argument("--watchdog", choices=("off", "realistic"), default="off")
    parser.add_argument("--no-point", action="store_true", help="run the quantile plans only")
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--model-error", type=float, default=0.0)
    parser.add_argument("--time-limit-s", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    errors = [float(x) for x in args.errors.split(",") if x]
    quantiles = [float(x) for x in args.quantiles.split(",") if x]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    nodes, per_node = (int(x) for x in args.cluster.lower().split("x"))
    trace = load_trace(args.data / "elasticflow" / "itp" / f"{args.trace}.csv", limit=args.jobs)
    series = load_intensity_csv(
        args.data / "carbon" / "electricitymaps" / f"{args.series}_hourly.csv"
    )
    profiles = load_scaling_profiles(args.data / "elasticflow" / "throughputs_A100")
    base = SimulationConfig(
        policy="greenflow",
        num_nodes=nodes,
        gpus_per_node=per_node,
        best_effort=True,
        time_limit_s=args.time_limit_s,
    )
    began = time.perf_counter()
    free = simulate_trace(trace, series, profiles, base)
    budget_kg = args.budget_share * free.emissions_kg
    plans: list[str] = [*([] if args.no_point else [POINT]), *(f"q{q:g}" for q in quantiles)]
    plan_quantiles: list[float | None] = [*([] if args.no_point else [None]), *quantiles]
    by_error: dict[str, Any] = {}
    for error in errors:
        runs: dict[str, list[dict[str, Any]]] = {plan: [] for plan in plans}
        for seed in seeds:
            for plan, quantile in zip(plans, plan_quantiles, strict=True):
                config = replace(
                    base,
                    budget_kg=budget_kg,
                    budget_period="day",
                    forecast_noise=args.noise,
                    forecast_error=error,
                    forecast_quantile=quantile,
                    commit_quantile=args.commit_quantile,
                    measured_now=not args.noisy_now,
                    model_error=args.model_error,
                    ideal_watchdog=False,
                    watchdog=WatchdogModel() if args.watchdog == "realistic" else None,
                    seed=seed,
                )
                report = simulate_trace(trace, series, profiles, config)
                runs[plan].append({"seed": seed, **run_summary(report)})
                print(
                    f"error {error:g} seed {seed} {plan}: {report.budget_violations} days over"
                    f" by {report.budget_overshoot_kg * 1000:.2f} g",
                    file=sys.stderr,
                )
        by_error[f"{error:g}"] = {
            "upper_factor_1h_24h": {
                f"q{q:g}": [
                    forecast_upper_factor(
                        replace(base, forecast_error=error, forecast_noise=args.noise), q, h
                    )
                    for h in (1, 24)
                ]
                for q in quantiles
            },
            "summary": {plan: aggregate(rows) for plan, rows in runs.items()},
            "runs": runs,
        }
    payload = {
        "settings": {
            "trace": args.trace,
            "jobs": args.jobs,
            "series": args.series,
            "cluster": args.cluster,
            "policy": "greenflow",
            "best_effort": True,
            "budget_period": "day",
            "budget_share": args.budget_share,
            "uncapped_emissions_kg": free.emissions_kg,
            "budget_kg": budget_kg,
            "forecast_noise": args.noise,
            "model_error": args.model_error,
            "seeds": seeds,
            "watchdog": args.watchdog,
            "commit_quantile": args.commit_quantile,
            "measured_now": not args.noisy_now,
            "time_limit_s": args.time_limit_s,
        },
        "by_forecast_error": by_error,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    text = json.dumps(payload, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
