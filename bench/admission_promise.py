"""Are admitted deadlines kept? greenflow and carbon-agnostic, exact models, no faults (issue 23).

Replays the first --jobs jobs of every ITP trace in ../shared/data/elasticflow/itp (A100
profiles, --cluster) and a seeded synthetic trace of long jobs with multi-day deadlines
(bench/long_deadline_trace.py, T4 profiles, --synthetic-cluster), at each --slots slot length,
with and without --elasticflow-events, no carbon limit (--carbon-price prices each kg in the
plans' objective, 0 by default), exact models and forecast (or with
--model-error / --forecast-error: then promises may break, and the figures say how often). The
horizon is `greenflow simulate`'s default for the trace and slot (cli.auto_horizon_slots). Cases
run in order (synthetic first, then the traces, the longer slot first) until --budget-s of wall
time is spent; those left are listed under "skipped". --placements replays each case pooled
(the cluster as one pool of GPUs), node-aware ("nodes": every plan goes through the live
service's placement, jobs may span every node) and/or "nodes:S" (only the first S nodes may be
spanned; nodes:0, every job inside one node), and reports what placement lowered (issue 20).

Prints {"cases": [{"trace", "jobs", "slot_s", "elasticflow_events", "horizon_slots",
"beyond_horizon", "policy", "placement", "carbon_price_s_per_kg", "switch_cost", "admitted", "deadline_jobs",
"met", "admitted_missed", "lateness_sum_s", "lateness_max_s", "missed", "placement_lowered",
"placement_lowered_jobs", "admitted_missed_lowered", "jobs_spanning_nodes", "wall_s"}],
"skipped", "settings"}; "missed" lists (job_id, lateness_s) of each broken promise.

Usage:
    nice -n 10 python -m bench.admission_promise [--data DIR] [--jobs 40 (0: none)] [--slots 900,60]
        [--traces cluster01,...] [--synthetic-jobs 40] [--budget-s 1800]
        [--placements pooled,nodes,nodes:0] [--carbon-price 200000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.long_deadline_trace import generate, write_trace_csv
from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.simulate.cli import auto_horizon_slots
from scheduler_service.simulate.engine import SimulationConfig, simulate_trace
from scheduler_service.simulate.trace import TraceJob, deadlines_beyond_horizon, load_trace

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
POLICIES = ("greenflow", "carbon-agnostic")


def run_case(
    name: str,
    jobs: list[TraceJob],
    profiles_dir: Path,
    carbon: Path,
    cluster: tuple[int, int],
    slot_s: float,
    events: bool,
    policy: str,
    time_limit_s: float,
    model_error: float = 0.0,
    forecast_error: float = 0.0,
    placement: str = "pooled",
    carbon_price_s_per_kg: float = 0.0,
    switch_cost: str = "measured",
) -> dict[str, Any]:
    """One replay's promise figures."""
    mode, _, spannable = placement.partition(":")
    horizon = auto_horizon_slots(jobs, slot_s)
    config = SimulationConfig(
        policy=policy,
        num_nodes=cluster[0],
        gpus_per_node=cluster[1],
        slot_s=slot_s,
        horizon_slots=horizon,
        elasticflow_events=events,
        time_limit_s=time_limit_s,
        model_error=model_error,
        forecast_error=forecast_error,
        carbon_price_s_per_kg=carbon_price_s_per_kg,
        switch_cost="flat" if switch_cost == "flat" else "measured",
        placement="nodes" if mode == "nodes" else "pooled",
        spannable_nodes=int(spannable) if spannable else None,
    )
    began = time.perf_counter()
    report = simulate_trace(
        jobs, load_intensity_csv(carbon), load_scaling_profiles(profiles_dir), config
    )
    wall_s = time.perf_counter() - began
    return {
        "trace": name,
        "jobs": len(jobs),
        "cluster": f"{cluster[0]}x{cluster[1]}",
        "slot_s": slot_s,
        "elasticflow_events": events,
        "horizon_slots": horizon,
        "beyond_horizon": deadlines_beyond_horizon(jobs, slot_s * horizon),
        "policy": policy,
        "placement": report.placement,
        "model_error": model_error,
        "forecast_error": forecast_error,
        "carbon_price_s_per_kg": carbon_price_s_per_kg,
        "switch_cost": report.switch_cost,
        "admitted": report.admitted,
        "deadline_jobs": report.deadline_jobs,
        "met": sum(1 for o in report.outcomes if o.deadline_met),
        "admitted_missed": report.admitted_missed,
        "lateness_sum_s": round(report.admitted_lateness_s["sum"], 1),
        "lateness_max_s": round(report.admitted_lateness_s["max"], 1),
        "missed": [
            (o.job_id, round(o.lateness_s or 0.0, 1))
            for o in report.outcomes
            if o.guaranteed and not o.deadline_met
        ],
        "placement_lowered": report.placement_lowered,
        "placement_lowered_jobs": report.placement_lowered_jobs,
        "admitted_missed_lowered": report.admitted_missed_lowered,
        "jobs_spanning_nodes": report.jobs_spanning_nodes,
        "wall_s": round(wall_s, 1),
    }


def _cluster(text: str) -> tuple[int, int]:
    nodes, per_node = (int(x) for x in text.lower().split("x"))
    return nodes, per_node


def main(argv: list[str] | None = None) -> int:
    """Run the cases within the wall-time budget and print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument(
        "--jobs", type=int, default=40, help="first N jobs of each ITP trace (0: no ITP trace)"
    )
    parser.add_argument("--traces", default="", help="ITP traces (default: all, smallest first)")
    parser.add_argument("--slots", default="900,60")
    parser.add_argument("--events", default="off,on", help="--elasticflow-events off, on or both")
    parser.add_argument("--cluster", default="2x8")
    parser.add_argument("--synthetic-jobs", type=int, default=40, help="0: no synthetic trace")
    parser.add_argument("--synthetic-seed", type=int, default=0)
    parser.add_argument("--synthetic-cluster", default="4x4")
    parser.add_argument("--carbon", default="ES_2021")
    parser.add_argument("--time-limit-s", type=float, default=0.5)
    parser.add_argument(
        "--carbon-price", type=float, default=0.0, help="s of weighted JCT per kg (soft trade-off)"
    )
    parser.add_argument("--budget-s", type=float, default=1800.0)
    parser.add_argument(
        "--switch-cost",
        choices=("measured", "flat"),
        default="measured",
        help="what a switch costs in the replay (the simulator's --switch-cost)",
    )
    parser.add_argument(
        "--model-error", type=float, default=0.0, help="relative std of each job's model error"
    )
    parser.add_argument(
        "--forecast-error", type=float, default=0.0, help="relative std of the forecast noise"
    )
    parser.add_argument(
        "--placements",
        default="pooled",
        help="pooled, nodes (every node may be spanned) and/or nodes:S (the first S may)",
    )
    args = parser.parse_args(argv)
    placements = [p for p in args.placements.split(",") if p]
    for placement in placements:
        mode, _, spannable = placement.partition(":")
        if mode not in ("pooled", "nodes") or (spannable and not spannable.isdigit()):
            parser.error(f"--placements: {placement!r} is not pooled, nodes or nodes:S")
    ef = args.data / "elasticflow"
    carbon = args.data / "carbon" / "electricitymaps" / f"{args.carbon}_hourly.csv"
    if not ef.is_dir() or not carbon.is_file():
        print(f"no shared data at {args.data}: pass --data", file=sys.stderr)
        return 2
    itp = ef / "itp"
    names = (
        []
        if args.jobs <= 0
        else [n for n in args.traces.split(",") if n]
        if args.traces
        else [p.stem for p in sorted(itp.glob("*.csv"), key=lambda p: p.stat().st_size)]
    )
    slots = [float(s) for s in args.slots.split(",") if s]
    events = [e == "on" for e in args.events.split(",") if e]
    plans: list[tuple[str, list[TraceJob], Path, tuple[int, int]]] = []
    if args.synthetic_jobs > 0:
        t4 = ef / "throughputs_T4"
        synthetic = generate(
            load_scaling_profiles(t4), args.synthetic_jobs, seed=args.synthetic_seed
        )
        # Written and read back, so the bench replays exactly the CSV the CLI would.
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "synthetic.csv"
            write_trace_csv(synthetic, path)
            synthetic = load_trace(path)
        name = f"synthetic-long(seed {args.synthetic_seed})"
        plans.append((name, synthetic, t4, _cluster(args.synthetic_cluster)))
    for name in names:
        plans.append(
            (
                name,
                load_trace(itp / f"{name}.csv", limit=args.jobs),
                ef / "throughputs_A100",
                _cluster(args.cluster),
            )
        )
    cases: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    began = time.perf_counter()
    for slot_s in sorted(slots, reverse=True):
        for trace_name, jobs, profiles_dir, cluster in plans:
            for ef_events in events:
                for policy in POLICIES:
                    for placement in placements:
                        key = {
                            "trace": trace_name,
                            "slot_s": slot_s,
                            "elasticflow_events": ef_events,
                            "policy": policy,
                            "placement": placement,
                        }
                        if time.perf_counter() - began > args.budget_s:
                            skipped.append(key)
                            continue
                        case = run_case(
                            trace_name,
                            jobs,
                            profiles_dir,
                            carbon,
                            cluster,
                            slot_s,
                            ef_events,
                            policy,
                            args.time_limit_s,
                            args.model_error,
                            args.forecast_error,
                            placement,
                            args.carbon_price,
                            args.switch_cost,
                        )
                        cases.append(case)
                        print(json.dumps(case), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "cases": cases,
                "skipped": skipped,
                "settings": {
                    "jobs": args.jobs,
                    "cluster": args.cluster,
                    "synthetic_jobs": args.synthetic_jobs,
                    "synthetic_cluster": args.synthetic_cluster,
                    "carbon": args.carbon,
                    "time_limit_s": args.time_limit_s,
                    "carbon_price_s_per_kg": args.carbon_price,
                    "switch_cost": args.switch_cost,
                    "model_error": args.model_error,
                    "forecast_error": args.forecast_error,
                    "placements": placements,
                    "budget_s": args.budget_s,
                    "wall_s": round(time.perf_counter() - began, 1),
                },
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
