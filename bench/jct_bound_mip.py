"""Tighter lower bounds on the capped average JCT (bench/schedule_quality.py's budget scenario)
than the fluid LP of bench/bounds/fluid.py. Prints JSON per series.

--method mip: the fluid LP plus, for the big jobs, binary "done by the end of segment k"
indicators (`avg_jct_lower_bound_mip`); the MIP's dual bound when stopped.
--method lagrange: capacity and budget rows priced, each job's exact completion time in its own
subproblem, prices by column generation (`lagrangian_bound.avg_jct_lagrangian_bound`).

Same jobs, cluster and budget as the bench: first --jobs jobs of ITP cluster01, 2x8, 900 s slots,
per-day budget = --budget-share x the uncapped best-effort carbon-agnostic run's emissions.

--slices A:B,C:D (with --cluster, e.g. 1x8): for each slice of consecutive trace jobs, its own
budget (the share of its own uncapped carbon-agnostic run), GreenFlow's and carbon-agnostic's
capped average JCT, the fluid LP bound, the Lagrangian bound, and the completion MIP with every
job binary (solved to its gap where it closes: a valid lower bound on every schedule of the
slice, unlike the MIP's incumbent). How far GreenFlow is from the tightest of them tells how much
of its distance to the Lagrangian bound on the full bench is the bound's looseness.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.bounds.completion_mip import avg_jct_lower_bound_mip
from bench.bounds.fluid import avg_jct_lower_bound
from bench.bounds.lagrangian import avg_jct_lagrangian_bound
from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.simulate.engine import SimulationConfig, simulate_trace
from scheduler_service.simulate.trace import load_trace

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def slices(args: argparse.Namespace) -> dict[str, object]:
    """The --slices analysis (module docstring), per series and slice."""
    ef = args.data / "elasticflow"
    every = load_trace(ef / "itp" / "cluster01.csv")
    profiles = load_scaling_profiles(ef / "throughputs_A100")
    nodes, per_node = (int(x) for x in args.cluster.lower().split("x"))
    out: dict[str, object] = {}
    for name in args.series.split(","):
        series = load_intensity_csv(args.data / "carbon" / "electricitymaps" / f"{name}_hourly.csv")
        rows = []
        for spec in args.slices.split(","):
            lo, hi = (int(x) for x in spec.split(":"))
            jobs = every[lo:hi]
            base = SimulationConfig(
                policy="carbon-agnostic",
                num_nodes=nodes,
                gpus_per_node=per_node,
                slot_s=900.0,
                horizon_slots=96,
                time_limit_s=0.5,
                best_effort=True,
            )
            reference = simulate_trace(jobs, series, profiles, base)
            capped = replace(
                base,
                budget_kg=reference.emissions_kg * args.budget_share,
                budget_period="day",
            )
            runs = {
                policy: simulate_trace(jobs, series, profiles, replace(capped, policy=policy))
                for policy in ("carbon-agnostic", "greenflow")
            }
            lp = avg_jct_lower_bound(jobs, series, profiles, capped)
            lag = avg_jct_lagrangian_bound(
                jobs,
                series,
                profiles,
                capped,
                horizon_s=lp.horizon_s,
                iterations=args.iterations,
                fine_s=args.fine_s,
            )
            mip = avg_jct_lower_bound_mip(
                jobs,
                series,
                profiles,
                capped,
                segment_s=args.segment_h * 3600.0,
                horizon_s=lp.horizon_s,
                time_limit_s=args.time_limit_s,
            )
            best_bound = max(lp.avg_jct_s, lag.avg_jct_s, mip.avg_jct_s)
            greenflow = runs["greenflow"].avg_jct_all_s or 0.0
            rows.append(
                {
                    "slice": spec,
                    "budget_kg": round(capped.budget_kg or 0.0, 4),
                    "greenflow_avg_jct_s": round(greenflow, 1),
                    "carbon_agnostic_avg_jct_s": round(
                        runs["carbon-agnostic"].avg_jct_all_s or 0.0, 1
                    ),
                    "unfinished": {k: r.unfinished for k, r in runs.items()},
                    "fluid_lp_s": round(lp.avg_jct_s, 1),
                    "lagrangian_s": round(lag.avg_jct_s, 1),
                    "completion_mip_s": round(mip.avg_jct_s, 1),
                    "mip_closed": mip.closed,
                    "mip_incumbent_s": None
                    if mip.incumbent_avg_jct_s is None
                    else round(mip.incumbent_avg_jct_s, 1),
                    "greenflow_over_lagrangian": round(greenflow / lag.avg_jct_s, 4),
                    "greenflow_over_best_bound": round(greenflow / best_bound, 4),
                }
            )
            print(f"{name} {json.dumps(rows[-1])}", file=sys.stderr)
        out[name] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--series", default="US-CAL-CISO_2021")
    parser.add_argument("--budget-share", type=float, default=0.5)
    parser.add_argument("--min-samples", type=float, default=10e6, help="jobs given binaries")
    parser.add_argument("--long-samples", type=float, default=10e6, help="full-horizon jobs")
    parser.add_argument("--segment-h", type=float, default=6.0)
    parser.add_argument("--time-limit-s", type=float, default=600.0)
    parser.add_argument("--job-span-h", type=float, default=72.0, help="others' own horizon")
    parser.add_argument("--display", action="store_true")
    parser.add_argument("--method", choices=["mip", "lagrange"], default="mip")
    parser.add_argument("--iterations", type=int, default=30, help="lagrange: subgradient steps")
    parser.add_argument("--fine-s", type=float, default=60.0, help="lagrange: finish-time grid")
    parser.add_argument("--step", type=float, default=1.0, help="lagrange: first step scale")
    parser.add_argument("--slices", default="", help="A:B,... slices of trace jobs (see above)")
    parser.add_argument("--cluster", default="2x8")
    args = parser.parse_args()
    if args.slices:
        print(json.dumps(slices(args), indent=2, default=float))
        return
    ef = args.data / "elasticflow"
    jobs = load_trace(ef / "itp" / "cluster01.csv", limit=args.jobs)
    profiles = load_scaling_profiles(ef / "throughputs_A100")
    out: dict[str, object] = {}
    for name in args.series.split(","):
        series = load_intensity_csv(args.data / "carbon" / "electricitymaps" / f"{name}_hourly.csv")

        def config(**extra: object) -> SimulationConfig:
            return SimulationConfig(
                policy="carbon-agnostic",
                num_nodes=2,
                gpus_per_node=8,
                slot_s=900.0,
                horizon_slots=96,
                time_limit_s=0.5,
                best_effort=True,
                **extra,  # type: ignore[arg-type]
            )

        reference = simulate_trace(jobs, series, profiles, config())
        capped = config(budget_kg=reference.emissions_kg * args.budget_share, budget_period="day")
        began = time.perf_counter()
        lp = avg_jct_lower_bound(jobs, series, profiles, capped)
        lp_s = time.perf_counter() - began
        print(f"{name} lp: {lp}", file=sys.stderr)
        if args.method == "lagrange":
            lag = avg_jct_lagrangian_bound(
                jobs,
                series,
                profiles,
                capped,
                horizon_s=lp.horizon_s,
                iterations=args.iterations,
                step=args.step,
                fine_s=args.fine_s,
                time_limit_s=args.time_limit_s,
                log=True,
            )
            out[name] = {
                "budget_kg_per_run": capped.budget_kg,
                "lp_bound_avg_jct_s": round(lp.avg_jct_s, 1),
                "lagrangian": vars(lag),
            }
            continue
        big = {j.job_id for j in jobs if j.total_samples > args.min_samples}
        long_jobs = {j.job_id for j in jobs if j.total_samples > args.long_samples}
        mip = avg_jct_lower_bound_mip(
            jobs,
            series,
            profiles,
            capped,
            binary_jobs=big,
            segment_s=args.segment_h * 3600.0,
            horizon_s=lp.horizon_s,
            time_limit_s=args.time_limit_s,
            job_span_s=args.job_span_h * 3600.0 if args.job_span_h > 0 else None,
            full_horizon_jobs=long_jobs,
            display=args.display,
        )
        print(f"{name} mip: {mip}", file=sys.stderr)
        out[name] = {
            "budget_kg_per_run": capped.budget_kg,
            "lp_bound_avg_jct_s": round(lp.avg_jct_s, 1),
            "lp_solve_s": round(lp_s, 1),
            "mip": {k: v for k, v in vars(mip).items()},
        }
    print(json.dumps(out, indent=2, default=float))


if __name__ == "__main__":
    main()
