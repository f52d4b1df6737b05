"""`greenflow simulate`: replay a job trace through a policy (the lead registers the command)."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Literal, cast

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.allocation.policies import POLICIES
from scheduler_service.simulate.engine import (
    SimulationConfig,
    SimulationError,
    SimulationReport,
    WatchdogModel,
    run_budget_periods,
    simulate_trace,
)
from scheduler_service.simulate.trace import (
    TraceError,
    TraceJob,
    deadlines_beyond_horizon,
    load_trace,
)

# The default horizon covers the trace's deadlines within these bounds: 48 slots was the fixed
# default before; 192 keeps one tick's solve within a few times that (the greedy is linear in
# the slots), and a longer reach is a coarser --slot-s (docs/allocation.md, "Simulator").
MIN_AUTO_HORIZON_SLOTS = 48
MAX_AUTO_HORIZON_SLOTS = 192
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
        (
            "admitted deadlines missed (lateness sum / max)",
            f"{report.admitted_missed} ({report.admitted_lateness_s['sum']:,.0f} s"
            f" / {report.admitted_lateness_s['max']:,.0f} s)",
        ),
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
        (
            "placement (job-steps lowered / jobs / broken promises among them; jobs across nodes)",
            f"{report.placement}: {report.placement_lowered} / {report.placement_lowered_jobs}"
            f" / {report.admitted_missed_lowered}; {report.jobs_spanning_nodes}",
        ),
        ("jobs placement moved to make room (moves)", str(report.placement_moves)),
        ("switch cost", report.switch_cost),
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
        int | None,
        typer.Option(
            "--horizon-slots",
            help=(
                "Slots the planner looks ahead (default: enough to cover the trace's farthest"
                f" deadline, {MIN_AUTO_HORIZON_SLOTS}-{MAX_AUTO_HORIZON_SLOTS} slots)."
            ),
        ),
    ] = None,
    carbon_price: Annotated[
        float,
        typer.Option(
            "--carbon-price", help="Seconds of weighted JCT one kg CO2e is worth (soft trade-off)."
        ),
    ] = 0.0,
    switch_s: Annotated[
        float,
        typer.Option(
            "--switch-s",
            help=(
                "Progress a GPU-count change costs as the policies plan it (s); with"
                " --switch-cost flat also what the replay charges."
            ),
        ),
    ] = 30.0,
    switch_cost: Annotated[
        str,
        typer.Option(
            "--switch-cost",
            help=(
                "measured: the replay charges each switch the measured cost model (model size,"
                " GPUs per node before and after, across nodes or not); flat: --switch-s each."
            ),
        ),
    ] = "measured",
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
    forecast_noise: Annotated[
        str,
        typer.Option(
            "--forecast-noise",
            help=(
                "flat: --forecast-error is a relative std at every horizon; measured: our"
                " forecaster's measured spread per horizon hour, times --forecast-error."
            ),
        ),
    ] = "flat",
    forecast_quantile: Annotated[
        float | None,
        typer.Option(
            "--forecast-quantile",
            help=(
                "Under a hard budget plan with this quantile (0.5-0.99) of the intensity per slot,"
                " from the --forecast-error noise, as the service plans with its forecaster's"
                " measured error (default: the noisy forecast itself)."
            ),
            min=0.5,
            max=0.99,
        ),
    ] = None,
    commit_quantile: Annotated[
        float,
        typer.Option(
            "--commit-quantile",
            help=(
                "With --forecast-quantile: the quantile the forecast part of the slot about to run"
                " is planned with (its spend is committed before the next plan; the service's"
                " budget.commit_quantile); 0.5 or --forecast-quantile: no such reserve."
            ),
            min=0.5,
            max=0.9999,
        ),
    ] = 0.999,
    noisy_now: Annotated[
        bool,
        typer.Option(
            "--noisy-now",
            help=(
                "Forecast noise on the hour running now too (default: that hour is measured, as"
                " the service's provider reports the intensity now)."
            ),
        ),
    ] = False,
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
    no_watchdog: Annotated[
        bool,
        typer.Option(
            "--no-watchdog",
            help=(
                "No budget watchdog at all: steps run as planned whatever they spend, so a hard"
                " budget holds only as far as the plans keep it."
            ),
        ),
    ] = False,
    placement: Annotated[
        str,
        typer.Option(
            "--placement",
            help=(
                "pooled: the --cluster GPUs as one pool (every plan runs as planned); nodes: each"
                " plan goes through the live service's placement onto the --cluster nodes and a"
                " job runs on what it places (counts placement lowers are reported)."
            ),
        ),
    ] = "pooled",
    spannable_nodes: Annotated[
        int | None,
        typer.Option(
            "--spannable-nodes",
            help=(
                "With --placement nodes: how many nodes a job may span (agents with a rendezvous"
                " address); default all; 0: every job runs inside one node."
            ),
        ),
    ] = None,
    no_placement_moves: Annotated[
        bool,
        typer.Option(
            "--no-placement-moves",
            help=(
                "With --placement nodes: placement never places a job on another node to make"
                " room (counts that fit on no node as jobs sit are lowered)."
            ),
        ),
    ] = False,
    no_placement_moves_running: Annotated[
        bool,
        typer.Option(
            "--no-placement-moves-running",
            help=(
                "With --placement nodes: placement moves only jobs that hold no GPUs (queued,"
                " paused) to make room, never a running one (the live service moves both)."
            ),
        ),
    ] = False,
    limit: Annotated[
        int | None, typer.Option("--limit", help="Replay only the first N jobs of the trace.")
    ] = None,
    time_limit_s: Annotated[
        float, typer.Option("--time-limit-s", help="Solver time limit per tick (s).")
    ] = 2.0,
    replan: Annotated[
        str,
        typer.Option(
            "--replan",
            help=(
                "every-step: solve at every step. on-change: a step with no arrival, completion"
                " or budget keeps the plan in force one slot on while it keeps its deadlines and"
                " projected finishes (fewer solves; figures may differ slightly)."
            ),
        ),
    ] = "every-step",
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
    if placement not in ("pooled", "nodes"):
        raise typer.BadParameter("must be pooled or nodes", param_hint="--placement")
    if switch_cost not in ("flat", "measured"):
        raise typer.BadParameter("must be flat or measured", param_hint="--switch-cost")
    if forecast_noise not in ("flat", "measured"):
        raise typer.BadParameter("must be flat or measured", param_hint="--forecast-noise")
    if replan not in ("every-step", "on-change"):
        raise typer.BadParameter("must be every-step or on-change", param_hint="--replan")
    if elasticflow_overhead and not elasticflow_events:
        raise typer.BadParameter(
            "needs --elasticflow-events: ElasticFlow charges its overhead once per merged"
            " event, and without one-slot steps events are far more frequent",
            param_hint="--elasticflow-overhead",
        )
    watchdog = parse_watchdog(watchdog_check_s, watchdog_telemetry_s, watchdog_tick_s, budget_kg)
    if no_watchdog and watchdog is not None:
        raise typer.BadParameter(
            "cannot be combined with the --watchdog-* flags", param_hint="--no-watchdog"
        )
    nodes, per_node = parse_cluster(cluster)
    if horizon_slots is not None and horizon_slots < 1:
        raise typer.BadParameter(
            f"must be at least 1; got {horizon_slots}", param_hint="--horizon-slots"
        )
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
        if horizon_slots is None:
            horizon_slots = auto_horizon_slots(trace, slot_s)
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
            switch_cost=cast(Literal["flat", "measured"], switch_cost),
            deadline_margin_s=deadline_margin_s,
            best_effort=best_effort,
            forecast_noise=cast(Literal["flat", "measured"], forecast_noise),
            forecast_error=forecast_error,
            forecast_quantile=forecast_quantile,
            commit_quantile=commit_quantile,
            measured_now=not noisy_now,
            model_error=model_error,
            elasticflow_events=elasticflow_events,
            elasticflow_overhead=elasticflow_overhead,
            watchdog=watchdog,
            ideal_watchdog=not no_watchdog,
            placement=cast(Literal["pooled", "nodes"], placement),
            spannable_nodes=spannable_nodes,
            placement_moves=not no_placement_moves,
            placement_moves_running=not no_placement_moves_running,
            time_limit_s=time_limit_s,
            seed=seed,
            replan=cast(Literal["every-step", "on-change"], replan),
        )
    except (TraceError, SimulationError, FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    beyond = deadlines_beyond_horizon(trace, slot_s * horizon_slots)
    if beyond:
        typer.echo(
            f"warning: {beyond} of {len(trace)} jobs have a deadline further off than the "
            f"{slot_s * horizon_slots / 3600:g} h planning horizon ({horizon_slots} slots of "
            f"{slot_s:g} s); past it the plans let each run alone at full speed (admission only"
            " checks that their work fits the cluster's GPU-seconds there), so deadline "
            "figures are not directly comparable with ElasticFlow's simulator: raise "
            "--horizon-slots, or --slot-s for a longer reach at the same solve cost",
            err=True,
        )
    console = Console(stderr=True)
    began = time.perf_counter()
    _, span_s, _ = run_budget_periods(config, trace)
    with Progress(
        TextColumn("[bold]simulating"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TextColumn("{task.fields[simulated]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        # Off when stderr is not a terminal (a pipe or a log file gets no control codes).
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task("replay", total=1.0, simulated="")

        def show(fraction: float) -> None:
            simulated_h = fraction * span_s / 3600
            bar.update(
                task,
                completed=fraction,
                simulated=f"{simulated_h:,.1f} of {span_s / 3600:,.1f} simulated h",
            )

        try:
            report = simulate_trace(trace, series, tables, config, progress=show)
        except (TraceError, SimulationError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
    wall_s = time.perf_counter() - began
    Console().print(report_table(report))
    payload = {
        **report.summary(),
        "wall_s": round(wall_s, 3),
        "jobs_detail": [o.__dict__ for o in report.outcomes],
        "config": asdict(config),
    }
    out.write_text(json.dumps(payload, indent=2, default=str))


def auto_horizon_slots(trace: list[TraceJob], slot_s: float) -> int:
    """Slots that cover the trace's farthest deadline from its submission, within
    [MIN_AUTO_HORIZON_SLOTS, MAX_AUTO_HORIZON_SLOTS] (the solve's cost grows with the slots)."""
    windows = [j.deadline_s - j.submission_s for j in trace if j.deadline_s is not None]
    need = math.ceil(max(windows, default=0.0) / slot_s)
    return int(min(MAX_AUTO_HORIZON_SLOTS, max(MIN_AUTO_HORIZON_SLOTS, need)))
