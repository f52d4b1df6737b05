"""`greenflow simulate`: replay a job trace through a policy (the lead registers the command)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Literal, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.allocation.policies import POLICIES
from scheduler_service.simulate.engine import (
    SimulationConfig,
    SimulationError,
    SimulationReport,
    WatchdogModel,
    simulate_trace,
)
from scheduler_service.simulate.trace import TraceError, deadlines_beyond_horizon, load_trace

DEFAULT_PROFILES = (
    Path(__file__).resolve().parents[2].parent
    / "shared"
    / "data"
    / "elasticflow"
    / "throughputs_A100"
)


def parse_cluster(text: str) -> tuple[int, int]:
    """`NODESxGPUS_PER_NODE` (e.g. `16x8`) -> (nodes, gpus per node)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise typer.BadParameter(
            f"cluster must look like NODESxGPUS_PER_NODE with positive numbers, e.g. 16x8; got {text!r}",
            param_hint="--cluster",
        )
    return int(match.group(1)), int(match.group(2))


def parse_watchdog(
    check_s: float | None, telemetry_s: float | None, tick_s: float | None, budget_kg: float | None
) -> WatchdogModel | None:
    """The realistic watchdog the `--watchdog-*` flags ask for (None: the ideal one)."""
    given = {
        "--watchdog-check-s": check_s,
        "--watchdog-telemetry-s": telemetry_s,
        "--watchdog-tick-s": tick_s,
    }
    for flag, value in given.items():
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise typer.BadParameter(
                f"must be a positive number of seconds; got {value}", param_hint=flag
            )
    if all(value is None for value in given.values()):
        return None
    if budget_kg is None:
        flag = next(flag for flag, value in given.items() if value is not None)
        raise typer.BadParameter(
            "needs --budget-kg: the watchdog only watches a hard budget", param_hint=flag
        )
    defaults = WatchdogModel()
    return WatchdogModel(
        check_interval_s=check_s,
        telemetry_interval_s=defaults.telemetry_interval_s if telemetry_s is None else telemetry_s,
        tick_s=defaults.tick_s if tick_s is None else tick_s,
    )


def report_table(report: SimulationReport) -> Table:
    """The report's headline figures as a rich table."""
    table = Table(title=f"greenflow simulate — policy {report.policy}")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
        return "—" if value is None else f"{value:,.{digits}f}{unit}"

    rows = [
        ("jobs (admitted / finished)", f"{report.jobs} ({report.admitted} / {report.finished})"),
        ("deadline met", f"{report.deadline_met_ratio:.1%} of {report.deadline_jobs}"),
        ("average JCT (finished jobs)", fmt(report.avg_jct_s, " s")),
        ("average JCT (all admitted, unfinished to the end)", fmt(report.avg_jct_all_s, " s")),
        ("p95 JCT", fmt(report.p95_jct_s, " s")),
        ("energy", fmt(report.energy_kwh, " kWh", 2)),
        ("emissions", fmt(report.emissions_kg, " kg CO2e", 3)),
        ("budget (whole run)", fmt(report.budget_kg, " kg", 3)),
        (
            "budget allowance (incl. periods after the trace span)",
            f"{fmt(report.budget_allowance_kg, ' kg', 3)}"
            f" ({report.budget_periods_after_span} periods after the span)",
        ),
        (
            "budget violations",
            f"{report.budget_violations} ({report.budget_overshoot_kg:.3f} kg over)",
        ),
        (
            "steps the budget watchdog cut short (its wakes with --watchdog-*)",
            str(report.budget_cuts),
        ),
        ("GPU utilisation", f"{report.gpu_utilisation:.1%}"),
        ("GPU-count changes", str(report.gpu_changes)),
        (
            "solver time per tick",
            f"mean {report.solver_s_mean * 1e3:.1f} ms, p95 {report.solver_s_p95 * 1e3:.1f} ms, max {report.solver_s_max * 1e3:.1f} ms",
        ),
        ("ticks", str(report.ticks)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def simulate(
    jobs: Annotated[Path, typer.Option("--jobs", help="Job trace CSV (ElasticFlow format).")],
    carbon: Annotated[
        Path,
        typer.Option("--carbon", help="Intensity CSV (Electricity Maps export or time,intensity)."),
    ],
    cluster: Annotated[str, typer.Option("--cluster", help="NODESxGPUS_PER_NODE, e.g. 16x8.")],
    policy: Annotated[str, typer.Option("--policy", help=f"One of: {', '.join(POLICIES)}.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the JSON report.")],
    budget_kg: Annotated[
        float | None,
        typer.Option(
            "--budget-kg", help="Carbon budget for the whole run (kg CO2e); unlimited if omitted."
        ),
    ] = None,
    budget_period: Annotated[
        str, typer.Option("--budget-period", help="Split the budget evenly per day, week, or run.")
    ] = "run",
    profiles: Annotated[
        Path | None,
        typer.Option("--profiles", help="Directory of throughputs_*/<model>.csv tables."),
    ] = None,
    slot_s: Annotated[float, typer.Option("--slot-s", help="Slot length in seconds.")] = 900.0,
    horizon_slots: Annotated[
        int, typer.Option("--horizon-slots", help="Slots the planner looks ahead.")
    ] = 48,
    carbon_price: Annotated[
        float,
        typer.Option(
            "--carbon-price", help="Seconds of weighted JCT one kg CO2e is worth (soft trade-off)."
        ),
    ] = 0.0,
    switch_s: Annotated[
        float, typer.Option("--switch-s", help="Progress lost per GPU-count change (s).")
    ] = 30.0,
    deadline_margin_s: Annotated[
        float | None,
        typer.Option(
            "--deadline-margin-s",
            help="Policies see deadlines this much early while still meetable (default 2 x switch).",
        ),
    ] = None,
    best_effort: Annotated[
        bool,
        typer.Option(
            "--best-effort",
            help="Run deadline jobs admission cannot guarantee without a guarantee (not rejected).",
        ),
    ] = False,
    forecast_error: Annotated[
        float, typer.Option("--forecast-error", help="Relative std of forecast noise.")
    ] = 0.0,
    model_error: Annotated[
        float, typer.Option("--model-error", help="Relative std of throughput/power model error.")
    ] = 0.0,
    elasticflow_events: Annotated[
        bool,
        typer.Option(
            "--elasticflow-events",
            help="ElasticFlow's event handling: one-slot steps, arrivals admitted per batch.",
        ),
    ] = False,
    elasticflow_overhead: Annotated[
        bool,
        typer.Option(
            "--elasticflow-overhead",
            help=(
                "ElasticFlow's per-event overhead: at every event each running job loses 2-68 s"
                " of progress (its GPU-set cache, restarts every N-th event for N = slot"
                " seconds), instead of --switch-s per count change (--switch-s then only sets"
                " what the policies see). Needs --elasticflow-events."
            ),
        ),
    ] = False,
    watchdog_check_s: Annotated[
        float | None,
        typer.Option(
            "--watchdog-check-s",
            help=(
                "Model the service's budget watchdog as it runs instead of an ideal one: check"
                " the budget every this many seconds (default with any --watchdog-* flag: the"
                " service's rule, --slot-s / 5 within 1-300 s). Needs --budget-kg."
            ),
        ),
    ] = None,
    watchdog_telemetry_s: Annotated[
        float | None,
        typer.Option(
            "--watchdog-telemetry-s",
            help=(
                "Realistic watchdog: seconds between telemetry reports; the ledger lags the"
                " draw by one (default 5, the service's)."
            ),
        ),
    ] = None,
    watchdog_tick_s: Annotated[
        float | None,
        typer.Option(
            "--watchdog-tick-s",
            help=(
                "Realistic watchdog: seconds from a wake until its stop takes effect (default 2,"
                " the service's tick latency floor)."
            ),
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", help="Replay only the first N jobs of the trace.")
    ] = None,
    time_limit_s: Annotated[
        float, typer.Option("--time-limit-s", help="Solver time limit per tick (s).")
    ] = 2.0,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed for the solver and the error models.")
    ] = 0,
) -> None:
    """Replay a job trace through a policy in simulated time and report JCT, deadlines and carbon."""
    if policy not in POLICIES:
        raise typer.BadParameter(
            f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}", param_hint="--policy"
        )
    if budget_period not in ("day", "week", "run"):
        raise typer.BadParameter("must be day, week or run", param_hint="--budget-period")
    if elasticflow_overhead and not elasticflow_events:
        raise typer.BadParameter(
            "needs --elasticflow-events: ElasticFlow charges its overhead once per merged"
            " event, and without one-slot steps events are far more frequent",
            param_hint="--elasticflow-overhead",
        )
    watchdog = parse_watchdog(watchdog_check_s, watchdog_telemetry_s, watchdog_tick_s, budget_kg)
    nodes, per_node = parse_cluster(cluster)
    profile_dir = profiles or DEFAULT_PROFILES
    if profiles is None and not DEFAULT_PROFILES.is_dir():
        # The default is the shared data checkout beside the source tree; an installed copy
        # has none, so say which option supplies the tables.
        raise typer.BadParameter(
            f"no scaling profiles at the default {DEFAULT_PROFILES}; pass --profiles DIR "
            "(a directory of <model>.csv tables in the ElasticFlow throughputs_A100 format)",
            param_hint="--profiles",
        )
    try:
        trace = load_trace(jobs, limit=limit)
        series = load_intensity_csv(carbon)
        tables = load_scaling_profiles(profile_dir)
        config = SimulationConfig(
            policy=policy,
            num_nodes=nodes,
            gpus_per_node=per_node,
            slot_s=slot_s,
            horizon_slots=horizon_slots,
            budget_kg=budget_kg,
            budget_period=cast(Literal["day", "week", "run"], budget_period),
            carbon_price_s_per_kg=carbon_price,
            switch_s=switch_s,
            deadline_margin_s=deadline_margin_s,
            best_effort=best_effort,
            forecast_error=forecast_error,
            model_error=model_error,
            elasticflow_events=elasticflow_events,
            elasticflow_overhead=elasticflow_overhead,
            watchdog=watchdog,
            time_limit_s=time_limit_s,
            seed=seed,
        )
    except (TraceError, SimulationError, FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    beyond = deadlines_beyond_horizon(trace, slot_s * horizon_slots)
    if beyond:
        typer.echo(
            f"warning: {beyond} of {len(trace)} jobs have a deadline further off than the "
            f"{slot_s * horizon_slots / 3600:g} h planning horizon; admission assumes they run "
            "at full speed after it, so deadline figures are not directly comparable with "
            "ElasticFlow's simulator (raise --horizon-slots to cover them)",
            err=True,
        )
    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]simulating"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("replay", total=1.0)
        try:
            report = simulate_trace(
                trace, series, tables, config, progress=lambda f: bar.update(task, completed=f)
            )
        except (TraceError, SimulationError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
    Console().print(report_table(report))
    payload = {
        **report.summary(),
        "jobs_detail": [o.__dict__ for o in report.outcomes],
        "config": asdict(config),
    }
    out.write_text(json.dumps(payload, indent=2, default=str))
