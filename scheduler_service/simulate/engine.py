"""Trace replay: at every event build the AllocationProblem, call a policy, apply its slot one.

Semantics (ElasticFlow's deadline semantics with an unlimited budget): a step ends at the slot's
end, the next submission or a job's completion, whichever is first, and the policy re-plans
there, so a job is admitted at its submission time; a job with a deadline meets it only if it was
admitted and finished by it; throughput comes from measured scaling profiles. Where this differs
from ElasticFlow's own simulator see docs/allocation.md, "Comparability with ElasticFlow's
simulator". Trace time 0 is the
first timestamp of the carbon series, which wraps around when the trace is longer. Energy is
charged exactly against the real (trace) intensity step series; the solver sees a forecast that
may carry error, and job models that may carry error.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import cached_property
from statistics import NormalDist
from typing import Literal

import numpy as np

from energy_model.carbon.series import IntensitySeries
from energy_model.carbon.skill import PRIOR_QUANTILE, PRIOR_UPPER_LOG_ERROR_Q80
from energy_model.emissions import energy_kwh, facility_energy_kwh, interval_emissions_kg
from energy_model.profiles import ScalingProfile
from scheduler_service.allocation.admission import (
    AdmissionDecision,
    admit,
    after_horizon_overcommitted,
    seed_for,
)
from scheduler_service.allocation.policies import ADMISSION_CONTROL, UnknownPolicy, get_policy
from scheduler_service.allocation.problem import (
    AllocationPlan,
    AllocationProblem,
    BudgetMode,
    JobSpec,
)
from scheduler_service.allocation.snapshot import (
    BudgetWindow,
    ClusterSnapshot,
    PlannableJob,
    ProblemKnobs,
    build_problem,
    most_gpus_per_job,
    plan_job,
)
from scheduler_service.placement import (
    LIVE_MOVABLE,
    NOWHERE,
    NodeFacts,
    NodeSlots,
    Placement,
    lost_once_placed,
)
from scheduler_service.settings import ClusterConfig, PlannerConfig, default_budget_check_s
from scheduler_service.simulate.carry import carried_plan
from scheduler_service.simulate.switch_cost import SwitchCostModel, model_params
from scheduler_service.simulate.trace import JobTables, TraceJob, job_tables
from scheduler_service.simulate.watchdog import RealisticWatchdog

PERIOD_S = {"day": 86_400.0, "week": 7 * 86_400.0}


class SimulationError(ValueError):
    """The simulation's inputs cannot be replayed (the message says which and why)."""


@dataclass(frozen=True)
class WatchdogModel:
    """The service's budget watchdog as it runs (`simulate/watchdog.py`), not the ideal one.

    Defaults are the service's (`greenflow.toml`): checks every `slot_s / 5` within 1-300 s of
    the replay's slot, telemetry every 5 s, a tick of `planner.tick_latency_floor_s` (2 s).
    """

    check_interval_s: float | None = None  # None: the service's rule for the replay's slot
    telemetry_interval_s: float = ClusterConfig.model_fields["agent_telemetry_interval_s"].default
    tick_s: float = PlannerConfig.model_fields["tick_latency_floor_s"].default

    def __post_init__(self) -> None:
        for name in ("check_interval_s", "telemetry_interval_s", "tick_s"):
            value = getattr(self, name)
            if value is None and name == "check_interval_s":
                continue
            if not math.isfinite(value) or value <= 0:
                raise SimulationError(f"watchdog {name} must be a positive number; got {value}")

    def check_s(self, slot_s: float) -> float:
        """Seconds between checks in a replay with `slot_s`-second slots."""
        if self.check_interval_s is not None:
            return self.check_interval_s
        return default_budget_check_s(slot_s)


@dataclass(frozen=True)
class SimulationConfig:
    """Knobs of one replay."""

    policy: str
    num_nodes: int
    gpus_per_node: int
    slot_s: float = 900.0
    horizon_slots: int = 48
    budget_kg: float | None = None  # whole run; None = unlimited
    budget_period: Literal["day", "week", "run"] = "run"
    carbon_price_s_per_kg: float = 0.0
    pue: float = 1.0
    # What a hot switch costs: "measured", the switch cost model of the measured figures
    # (`switch_cost.SwitchCostModel`: model size, old and new GPUs per node, across nodes or
    # not); "flat", `switch_s` per GPU-count change. Either way the policies plan with `switch_s`.
    switch_cost: Literal["flat", "measured"] = "measured"
    switch_model: SwitchCostModel = field(default_factory=SwitchCostModel)
    switch_s: float = 30.0  # flat: progress lost per GPU-count change; what the policies see
    # Policies see deadlines this much earlier than the trace's, so a plan that finishes just in
    # time still does after a hot switch or two (None: 2 x switch_s).
    deadline_margin_s: float | None = None
    # Deadline jobs that admission cannot guarantee run without a guarantee instead of being
    # rejected (every job then finishes: the fair basis for comparing JCT).
    best_effort: bool = False
    # "flat": forecast = actual x N(1, forecast_error) per trace hour, at every horizon (the
    # current hour included). "measured": ln(actual / forecast) is normal with our forecaster's
    # spread at the slot's horizon hour (energy_model.carbon.skill's prior: 2.5 % at 1 h to
    # 11.7 % at 24 h) times `forecast_error` (1.0: as measured), one draw per trace hour scaled
    # by the horizon, so an hour's error shrinks (same sign) as it comes closer.
    forecast_noise: Literal["flat", "measured"] = "flat"
    forecast_error: float = 0.0  # flat: relative std; measured: scale of the measured spread
    # Under a hard budget, plan with this quantile of the intensity per slot instead of the noisy
    # forecast itself, as the service plans with its forecaster's measured error
    # (`forecast_upper_factor`); None: the forecast itself.
    forecast_quantile: float | None = None
    # With `forecast_quantile`: the quantile the forecast part of the slot about to run is planned
    # with (the service's `budget.commit_quantile`): what a step spends is committed before the
    # next plan can correct it, while later slots are planned again once measured. None: the
    # forecast quantile there too.
    commit_quantile: float | None = 0.999
    # The hour running now is measured, not forecast (the service plans with the intensity its
    # provider reports now): forecast noise applies to the hours not begun yet. False: the noise
    # applies to the hour running now too (the flat model's earlier figures).
    measured_now: bool = True
    model_error: float = 0.0  # relative std of the per-job throughput/power misestimate
    time_limit_s: float = 2.0
    seed: int = 0
    max_ticks: int = 200_000
    # ElasticFlow's event handling (its ef-accessctrl simulator): every step lasts one slot, so
    # arrivals and completions inside it are handled together at its end, and the deadline jobs
    # arriving together are admitted or declined together (any of them or an admitted job late
    # declines them all).
    elasticflow_events: bool = False
    # ElasticFlow's per-event overhead (`utils.estimate_overhead`): at every event every running
    # job loses a few seconds of progress (see `elasticflow_overhead_s`), instead of `switch_s`
    # per GPU-count change; `switch_s` then only sets what the policies see. Needs
    # `elasticflow_events`: without the merged one-slot steps events are far more frequent.
    elasticflow_overhead: bool = False
    # The service's budget watchdog as it runs (discrete checks, telemetry lag, tick latency);
    # None: the ideal one, which cuts a step exactly where the real spend reaches the budget.
    watchdog: WatchdogModel | None = None
    # False (with no `watchdog`): no budget watchdog at all, a step runs as planned whatever it
    # spends, so a hard budget holds only as far as the plans keep it (bench/budget_uncertainty.py).
    ideal_watchdog: bool = True
    # "pooled": one pool of num_nodes x gpus_per_node GPUs, every plan runs as planned (the
    # figures before issue 20). "nodes": every plan's first slot goes through the live service's
    # placement (`placement.place_jobs`) onto the nodes, and a job runs on what it places.
    placement: Literal["pooled", "nodes"] = "pooled"
    # With "nodes": how many nodes (the first ones) a job may span, as the live service spans
    # only nodes whose agents advertised a rendezvous address; None: all; 0 or 1: none, every
    # job runs inside one node.
    spannable_nodes: int | None = None
    # With "nodes": placement may move jobs whole to another node to make room for a count that
    # fits on no node as jobs sit (`placement.place_jobs(move_jobs=True)`); each move costs the
    # moved job a switch. As the live service (`placement.LIVE_MOVABLE`): running jobs too.
    placement_moves: bool = True
    # With "nodes" and `placement_moves`: False moves only jobs holding no slots (queued, paused),
    # the live service's rule before its two-step move of running jobs.
    placement_moves_running: bool = True
    # "every-step": the policy solves at every step. "on-change": a step that ended at its
    # slot's end with no arrival or completion, and no budget, keeps the plan in force one slot
    # on while it keeps its course (`carry.carried_plan`), else solves.
    replan: Literal["every-step", "on-change"] = "every-step"

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise SimulationError("cluster needs at least one node with one GPU")
        if self.slot_s <= 0 or self.horizon_slots < 1:
            raise SimulationError("slot_s must be > 0 and horizon_slots >= 1")
        if self.budget_kg is not None and self.budget_kg < 0:
            raise SimulationError("budget_kg must be >= 0")
        if self.switch_s < 0 or self.switch_s >= self.slot_s:
            raise SimulationError("switch_s must be >= 0 and shorter than a slot")
        if self.elasticflow_overhead and not self.elasticflow_events:
            raise SimulationError(
                "elasticflow_overhead needs elasticflow_events: ElasticFlow charges its "
                "overhead per merged event, and without the one-slot steps events are far "
                "more frequent"
            )
        if self.deadline_margin_s is not None and self.deadline_margin_s < 0:
            raise SimulationError("deadline_margin_s must be >= 0")
        if self.forecast_error < 0 or self.model_error < 0:
            raise SimulationError("forecast_error and model_error must be >= 0")
        for name in ("forecast_quantile", "commit_quantile"):
            quantile = getattr(self, name)
            if quantile is not None and not 0.5 <= quantile < 1.0:
                raise SimulationError(f"{name} must be in [0.5, 1)")
        if self.spannable_nodes is not None and (
            self.placement != "nodes" or not 0 <= self.spannable_nodes <= self.num_nodes
        ):
            raise SimulationError(
                f"spannable_nodes needs placement 'nodes' and 0..{self.num_nodes} nodes; "
                f"got {self.spannable_nodes} with placement {self.placement!r}"
            )
        if self.watchdog is not None and self.budget_kg is None:
            raise SimulationError("a watchdog model needs a budget: it only watches a hard budget")
        try:
            get_policy(self.policy)
        except UnknownPolicy as exc:
            raise SimulationError(str(exc)) from None

    @property
    def capacity_gpus(self) -> int:
        """GPUs in the cluster."""
        return self.num_nodes * self.gpus_per_node

    @property
    def node_gpus(self) -> tuple[int, ...]:
        """GPUs of each node."""
        return (self.gpus_per_node,) * self.num_nodes

    @property
    def spannable_gpus(self) -> tuple[int, ...]:
        """GPUs of each node a job may span (pooled: all, as one pool)."""
        count = self.num_nodes if self.spannable_nodes is None else self.spannable_nodes
        return self.node_gpus[:count]

    @property
    def job_gpus_max(self) -> int:
        """The most GPUs one job can run on: pooled, the cluster; else as the live service caps it."""
        if self.placement == "pooled":
            return self.capacity_gpus
        return most_gpus_per_job(self.node_gpus, self.spannable_gpus)

    @property
    def margin_s(self) -> float:
        """Seconds by which policies see deadlines early."""
        return 2 * self.switch_s if self.deadline_margin_s is None else self.deadline_margin_s


# ElasticFlow's overhead model, restated from pkusys/ElasticFlow `ElasticFlow/scheduler/utils.py`
# (`estimate_overhead`) and `scheduler.py` (`ef_sim_jobs_access_control`, the GPU-set cache in
# `log.py` `scheduling_result`); docs/allocation.md, "Comparability", has the details.
EF_LARGE_CLUSTER_GPUS = 256


def elasticflow_overhead_s(gpus: int, cluster_gpus: int, *, restart: bool, cached: bool) -> float:
    """Progress (s) ElasticFlow's simulator takes from a job running on `gpus` GPUs at one event."""
    large = cluster_gpus >= EF_LARGE_CLUSTER_GPUS
    base_s = 7.0 if large else 2.0
    if cached:
        # Its GPU set was used since the last restart: the base cost only, restart or not.
        return base_s
    restart_s = (47.0 if large else 27.0) if restart else 0.0
    return base_s + restart_s + 2.0 * (math.log2(gpus) + 1.0)


@dataclass
class ElasticFlowOverhead:
    """ElasticFlow's bookkeeping behind its overhead: events seen, restarts, used GPU sets."""

    cluster_gpus: int
    # ElasticFlow restarts every `scheduling_slot`-th event: it reuses the slot length in seconds
    # as a count of events (60 in its runs).
    restart_every_events: int
    events: int = 0
    used_gpu_sets: set[tuple[int, int]] = field(default_factory=set)

    def event(self, running: list[tuple[str, int]]) -> dict[str, float]:
        """Each running job's overhead (s) at one event, from (job id, GPUs) in our job order."""
        # ElasticFlow places every job anew at each event, largest first; on power-of-two nodes
        # a job's GPUs are then the contiguous ranks after those of the jobs placed before it.
        # Ties keep our job order (ElasticFlow's follows its marginal-gain ranking).
        cached: dict[str, bool] = {}
        first_rank = 0
        for job_id, gpus in sorted(running, key=lambda item: -item[1]):
            gpu_set = (first_rank, gpus)
            cached[job_id] = gpu_set in self.used_gpu_sets
            self.used_gpu_sets.add(gpu_set)
            first_rank += gpus
        restart = self.events > 0 and self.events % self.restart_every_events == 0
        self.events += 1
        if restart:
            # Cleared after this event's charges: the next event finds every GPU set new.
            self.used_gpu_sets.clear()
        return {
            job_id: elasticflow_overhead_s(
                gpus, self.cluster_gpus, restart=restart, cached=cached[job_id]
            )
            for job_id, gpus in running
        }


@dataclass
class _JobState:
    trace: TraceJob
    tables: JobTables
    seen: JobTables  # what the policy believes (model error applied)
    remaining_samples: float
    current_gpus: int = 0
    admitted: bool = True
    guaranteed: bool = True
    started: bool = False
    finish_s: float | None = None
    changes: int = 0
    # What is left of a hot switch cut short by an event (an arrival or a completion).
    stall_s: float = 0.0
    energy_kwh: float = 0.0
    emissions_kg: float = 0.0
    reject_reason: str = ""
    # Node-aware placement: steps it ran on fewer GPUs than planned (and the last reason), and
    # the most nodes it ran on at once.
    lowered: int = 0
    lowered_reason: str = ""
    nodes_max: int = 0
    moves: int = 0  # times placement moved it whole to another node to make room


@dataclass(frozen=True)
class JobOutcome:
    """What happened to one trace job."""

    job_id: str
    admitted: bool
    finish_s: float | None
    jct_s: float | None
    deadline_met: bool | None  # None: no deadline
    gpu_changes: int
    energy_kwh: float
    emissions_kg: float
    reject_reason: str = ""
    # Admitted with a promise to meet its deadline (not best-effort).
    guaranteed: bool = False
    # Seconds past its deadline a guaranteed job finished (or, unfinished, was when the replay
    # stopped: a lower bound); None for jobs without a promise, 0.0 for a promise kept.
    lateness_s: float | None = None
    # Steps placement ran it on fewer GPUs than the plan's (with the last reason), and the most
    # nodes it ran on at once (placement "nodes"; 0 and "" when pooled or never lowered).
    placement_lowered: int = 0
    placement_reason: str = ""
    nodes_max: int = 0
    placement_moves: int = 0  # times placement moved it whole to another node


@dataclass(frozen=True)
class SimulationReport:
    """The replay's figures (see docs/allocation.md for each definition)."""

    policy: str
    jobs: int
    admitted: int
    finished: int
    unfinished: int  # admitted but not finished when the replay stopped
    deadline_jobs: int
    deadline_met_ratio: float
    avg_jct_s: float | None  # finished jobs only
    p95_jct_s: float | None
    # Every admitted job; one left unfinished counts until the replay's end (a lower bound).
    avg_jct_all_s: float | None
    energy_kwh: float
    emissions_kg: float
    budget_kg: float | None
    # What the periods the replay reached allowed in all: budget_kg, plus one share per day/week
    # period after the trace's span that work ran into (None when unlimited).
    budget_allowance_kg: float | None
    budget_periods_after_span: int
    budget_violations: int
    budget_overshoot_kg: float
    # Steps the budget watchdog cut short: real power reached the period's budget before the
    # plan's slot ended (model or forecast error), so the policy re-planned at once. With a
    # `WatchdogModel`, the watchdog's wakes instead (each re-plans a tick's time after its check).
    budget_cuts: int
    gpu_utilisation: float
    gpu_changes: int
    ticks: int
    solver_s_mean: float
    solver_s_p95: float
    solver_s_max: float
    makespan_s: float
    # Promises broken: jobs admitted with a guaranteed deadline that finished after it (or not
    # at all), and by how much ({"sum", "max"} in seconds; unfinished ones count to the stop).
    admitted_missed: int = 0
    admitted_lateness_s: dict[str, float] = field(default_factory=lambda: {"sum": 0.0, "max": 0.0})
    # How plans met the nodes: "pooled", or "nodes NxG, S spannable" (SimulationConfig.placement).
    placement: str = "pooled"
    # Which switch cost the replay charged (`switch_cost_label`).
    switch_cost: str = ""
    # Jobs placement moved whole to another node to make room for another (moves, not jobs).
    placement_moves: int = 0
    # Job-steps placement ran on fewer GPUs than the plan, the jobs that happened to, and the
    # broken promises among them (issue 20's target: 0); jobs that ran across nodes.
    placement_lowered: int = 0
    placement_lowered_jobs: int = 0
    admitted_missed_lowered: int = 0
    jobs_spanning_nodes: int = 0
    # Steps that kept the plan in force one slot on instead of solving (replan "on-change").
    plans_carried: int = 0
    outcomes: list[JobOutcome] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, float | int | str | dict[str, float] | None]:
        """The report without the per-job outcomes (JSON-ready)."""
        return {k: v for k, v in self.__dict__.items() if k != "outcomes"}


class CarbonClock:
    """Maps trace seconds onto the (wrapping) intensity series; charges intervals exactly."""

    def __init__(self, series: IntensitySeries, pue: float) -> None:
        self.series = series
        self.pue = pue
        self.origin = series.times[0]
        steps = [
            (b - a).total_seconds() for a, b in zip(series.times, series.times[1:], strict=False)
        ]
        last_step = steps[-1] if steps else 3600.0
        self.span_s = (series.times[-1] - self.origin).total_seconds() + last_step
        self._cache: dict[tuple[float, float], float] = {}

    @cached_property
    def step_offsets_s(self) -> np.ndarray:
        """Each step's start in seconds from the origin (one wrap), computed on first use."""
        return np.array([(t - self.origin).total_seconds() for t in self.series.times])

    def kg_per_w(self, start_s: float, end_s: float) -> float:
        """kg CO2e per W drawn over trace interval [start_s, end_s) (PUE included)."""
        key = (start_s, end_s)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        total = 0.0
        cursor = start_s
        while cursor < end_s - 1e-9:
            wrapped = cursor % self.span_s
            piece = min(end_s - cursor, self.span_s - wrapped)
            begin = self.origin + timedelta(seconds=wrapped)
            total += interval_emissions_kg(
                1.0, begin, begin + timedelta(seconds=piece), self.series, self.pue
            )
            cursor += piece
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[key] = total
        return total

    def mean_intensity(self, start_s: float, end_s: float) -> float:
        """Average g/kWh over [start_s, end_s) (without PUE)."""
        hours = (end_s - start_s) / 3600.0
        return self.kg_per_w(start_s, end_s) / self.pue * 1000.0 * 1000.0 / hours


def placement_label(config: SimulationConfig) -> str:
    """How the replay's plans met the nodes, for its report."""
    if config.placement == "pooled":
        return "pooled"
    spannable = len(config.spannable_gpus)
    return (
        f"nodes {config.num_nodes}x{config.gpus_per_node}, "
        f"{spannable if spannable > 1 else 0} spannable"
        + (
            (
                ", jobs moved to make room"
                + ("" if config.placement_moves_running else " (not running ones)")
            )
            if config.placement_moves
            else ""
        )
    )


def switch_cost_label(config: SimulationConfig) -> str:
    """Which switch cost the replay charged, for its report."""
    if config.elasticflow_overhead:
        return "elasticflow: per-event overhead (utils.estimate_overhead)"
    if config.switch_cost == "flat":
        return f"flat: {config.switch_s:g} s per GPU-count change"
    return config.switch_model.label()


# A switch as placement made it: GPUs per node before and after, and the nodes holding the job's
# state before (where it ran, or where its paused state is).
Switch = tuple[dict[int, int], dict[int, int], frozenset[int]]


def _switch_stall_s(
    config: SimulationConfig, state: _JobState, gpus: int, switch: Switch | None
) -> float:
    """Progress a started job's switch to `gpus` costs (`config.switch_cost`); `switch`: how
    placement moved it (None: pooled, one node)."""
    if config.switch_cost == "flat":
        return config.switch_s
    if switch is None:
        switch = ({0: state.current_gpus}, {0: gpus}, frozenset({0}))
    old, new, holders = switch
    return config.switch_model.stall_s(model_params(state.trace.model_name), old, new, holders)


@dataclass
class NodePlacer:
    """The replay's nodes and where each job runs on them, placed by the live service's code.

    Each step's counts go through `placement.place_jobs` as the dispatcher calls it
    (`dispatch/service.decide`): jobs keep their slots, a paused job goes back to its home node,
    a job spans only the spannable nodes, higher priority and earlier deadline first. Trace jobs
    are data-parallel (tensor-parallel degree 1).
    """

    config: SimulationConfig
    placements: dict[int, Placement] = field(default_factory=dict)
    homes: dict[int, int] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)
    # The last step's placement of each job as a switch (`Switch`), and the jobs it moved whole
    # to another node to make room for another.
    switches: dict[str, Switch] = field(default_factory=dict)
    moved: set[str] = field(default_factory=set)

    def place(self, targets: dict[str, int], states: dict[str, _JobState]) -> dict[str, int]:
        """The GPUs each job runs on when `targets` (GPUs per job) are placed; records on each
        job's state the steps placement lowered it and why, and the nodes it spans."""
        for job_id in targets:
            self.ids.setdefault(job_id, len(self.ids))
        by_id = {self.ids[j]: j for j in targets}
        placed = self._facts().place(
            {self.ids[j]: gpus for j, gpus in targets.items()},
            {self.ids[j]: states[j].seen.allowed_gpus for j in targets},
            [self.ids[j] for j in sorted(targets, key=lambda j: self._rank(j, states))],
        )
        before = self.placements
        self.placements = {i: placed.placements.get(i, NOWHERE) for i in by_id}
        self.moved = {by_id[i] for i in placed.moved if i in by_id}
        self.switches = {}
        counts: dict[str, int] = {}
        for i, job_id in by_id.items():
            where = self.placements[i]
            state = states[job_id]
            old = before.get(i, NOWHERE)
            holders = {n for n, _ in old.parts} or ({self.homes[i]} if i in self.homes else set())
            self.switches[job_id] = (
                {n: len(s) for n, s in old.parts},
                {n: len(s) for n, s in where.parts},
                frozenset(holders),
            )
            if where.node_id is not None:
                self.homes[i] = where.node_id
            state.nodes_max = max(state.nodes_max, len(where.parts))
            state.moves += job_id in self.moved
            if i in placed.short:
                state.lowered += 1
                state.lowered_reason = placed.short[i]
            counts[job_id] = where.gpus
        return counts

    def lost_deadlines(
        self,
        problem: AllocationProblem,
        plan: AllocationPlan,
        new_jobs: Collection[str],
        states: dict[str, _JobState],
    ) -> list[str]:
        """Deadlines an admission plan meets on pooled capacity that placing it slot by slot on
        the nodes loses: a new job's, or another's that the plan without the new jobs keeps."""
        return lost_once_placed(problem, plan, new_jobs, lambda gpus: self._placed(gpus, states))

    def _placed(
        self, gpus: dict[str, tuple[int, ...]], states: dict[str, _JobState]
    ) -> dict[str, tuple[int, ...]]:
        """The counts of every slot of `gpus` as placement runs them, from where jobs are now."""
        for job_id in gpus:
            self.ids.setdefault(job_id, len(self.ids))
        rows = self._facts().place_rows(
            {self.ids[j]: row for j, row in gpus.items()},
            {self.ids[j]: states[j].seen.allowed_gpus for j in gpus},
            [self.ids[j] for j in sorted(gpus, key=lambda j: self._rank(j, states))],
        )
        return {j: rows[self.ids[j]] for j in gpus}

    def _facts(self) -> NodeFacts:
        """The nodes and where jobs are, as the live service's placement takes them."""
        config = self.config
        return NodeFacts(
            nodes=tuple(
                NodeSlots(n, tuple(range(config.gpus_per_node))) for n in range(config.num_nodes)
            ),
            spannable=frozenset(range(len(config.spannable_gpus))),
            current={i: p for i, p in self.placements.items() if p.node_id is not None},
            homes={
                i: n
                for i, n in self.homes.items()
                if self.placements.get(i, NOWHERE).node_id is None
            },
            move_jobs=config.placement_moves,
            movable=LIVE_MOVABLE if config.placement_moves_running else frozenset(),
        )

    def _rank(self, job_id: str, states: dict[str, _JobState]) -> tuple[float, int]:
        """Placement order: earlier deadline first, then earlier arrival (the dispatcher's)."""
        deadline_s = states[job_id].trace.deadline_s
        return (math.inf if deadline_s is None else deadline_s, self.ids[job_id])

    def refuse(
        self,
        decision: AdmissionDecision,
        problem: AllocationProblem,
        new_jobs: Collection[str],
        states: dict[str, _JobState],
        best_effort: bool,
    ) -> AdmissionDecision:
        """`decision` unless its plan, placed on the nodes, loses a deadline it promises: then
        no guarantee (best-effort, or rejected), with the reason."""
        if not decision.guaranteed or decision.plan is None:
            return decision
        lost = self.lost_deadlines(problem, decision.plan, new_jobs, states)
        if not lost:
            return decision
        why = (
            f"placed on the nodes (a job spans only spannable nodes), the plan misses the "
            f"deadlines of {', '.join(lost[:5])}"
        )
        if best_effort:
            return AdmissionDecision(True, False, f"queued best-effort: {why}", decision.plan)
        return AdmissionDecision(False, False, f"rejected: {why}", decision.plan)


def simulate_trace(
    jobs: list[TraceJob],
    series: IntensitySeries,
    profiles: dict[str, ScalingProfile],
    config: SimulationConfig,
    progress: Callable[[float], None] | None = None,
) -> SimulationReport:
    """Replay `jobs` under `config.policy`; `progress` gets the fraction of the trace replayed."""
    if not jobs:
        raise SimulationError("the trace has no jobs")
    policy = get_policy(config.policy)
    rng = np.random.default_rng(config.seed)
    clock = CarbonClock(series, config.pue)
    capacity = config.capacity_gpus
    placer = NodePlacer(config) if config.placement == "nodes" else None
    slot_s = config.slot_s
    start_s, run_span_s, periods = run_budget_periods(config, jobs)
    spent_kg = [0.0] * len(periods)
    periods_in_span = len(periods)
    period_share_kg = periods[0].budget_kg if periods else 0.0

    states: dict[str, _JobState] = {}
    pending = list(jobs)
    next_arrival = 0
    active: list[str] = []
    previous: AllocationPlan | None = None
    solver_times: list[float] = []
    plans_carried = 0
    busy_gpu_s = 0.0
    now = start_s
    ticks = 0
    idle_ticks = 0
    idle_limit = 2 * config.horizon_slots
    if periods and config.budget_period in PERIOD_S:
        # A spent daily/weekly budget comes back with the next period: wait for it.
        idle_limit += math.ceil(PERIOD_S[config.budget_period] / slot_s)
    last_activity_s = start_s
    budget_cuts = 0
    ef_overhead = (
        ElasticFlowOverhead(capacity, max(1, round(slot_s)))
        if config.elasticflow_overhead
        else None
    )
    watchdog = (
        RealisticWatchdog(
            check_interval_s=config.watchdog.check_s(slot_s),
            telemetry_interval_s=config.watchdog.telemetry_interval_s,
            tick_s=config.watchdog.tick_s,
            kg_per_w=clock.kg_per_w,
            origin=clock.origin,
        )
        if config.watchdog is not None and periods
        else None
    )
    completed_in_step = False
    while ticks < config.max_ticks:
        _extend_periods(
            config, periods, spent_kg, period_share_kg, now + 2 * config.horizon_slots * slot_s
        )
        # Arrivals up to now join at this boundary.
        batch: list[str] = []
        arrivals_before = next_arrival
        while next_arrival < len(pending) and pending[next_arrival].submission_s <= now + 1e-9:
            job = pending[next_arrival]
            next_arrival += 1
            state = _new_state(job, profiles, config.job_gpus_max, config, rng)
            states[job.job_id] = state
            if job.deadline_s is not None and config.policy in ADMISSION_CONTROL:
                if config.elasticflow_events:
                    batch.append(job.job_id)
                    continue
                problem = _problem(config, clock, states, active, now, periods, spent_kg)
                best_effort = config.best_effort or job.best_effort
                new_spec = plan_job(
                    replace(_plannable(state, now), best_effort=best_effort),
                    _knobs(config, periods),
                )
                decision = admit(
                    problem,
                    new_spec,
                    time_limit_s=config.time_limit_s,
                    seed=config.seed,
                    policy=policy,
                    previous=previous,
                )
                if placer is not None:
                    # Admission promises only what its plan keeps once placed on the nodes.
                    decision = placer.refuse(
                        decision,
                        replace(problem, jobs=(*problem.jobs, new_spec)),
                        {job.job_id},
                        states,
                        best_effort,
                    )
                state.admitted = decision.admitted
                state.guaranteed = decision.guaranteed
                if not decision.admitted:
                    state.reject_reason = decision.reason
                    continue
                if decision.plan is not None:
                    # The next tick warm-starts from the plan that made the guarantee (the
                    # previous plan is one of its candidates): its own solve, at the full time
                    # limit, runs other steps than admission's and need not find that plan.
                    previous = decision.plan
            active.append(job.job_id)
        if batch:
            batch_plan = _admit_batch(
                config,
                policy,
                clock,
                states,
                active,
                now,
                periods,
                spent_kg,
                batch,
                previous,
                placer,
            )
            if batch_plan is not None:
                previous = batch_plan
        # An ElasticFlow event: jobs arrived or finished (the GPU-count changes of a plan are its
        # other kind, checked below).
        ef_event = next_arrival > arrivals_before or completed_in_step
        completed_in_step = False
        if not active:
            if ef_overhead is not None and ef_event:
                ef_overhead.event([])
            if next_arrival >= len(pending):
                break
            # Fast-forward to the next arrival.
            now = max(now, pending[next_arrival].submission_s)
            previous = None
            continue
        problem = _problem(config, clock, states, active, now, periods, spent_kg)
        carried = None
        if config.replan == "on-change" and not ef_event and not periods:
            carried = carried_plan(problem, previous)
        if carried is None:
            began = time.perf_counter()
            plan = policy(
                problem, previous=previous, time_limit_s=config.time_limit_s, seed=config.seed
            )
            solver_times.append(time.perf_counter() - began)
        else:
            plan = carried
            plans_carried += 1
        previous = plan
        ticks += 1
        used = sum(plan.gpus[j][0] for j in active)
        if used > config.capacity_gpus:
            raise SimulationError(
                f"policy {config.policy} planned {used} GPUs on a {config.capacity_gpus}-GPU cluster"
            )
        # The GPUs each job runs on in this step: the plan's first slot, or what placement keeps
        # of it on the nodes.
        first = {j: plan.gpus[j][0] for j in active}
        if placer is not None:
            first = placer.place(first, states)
        idle_ticks = idle_ticks + 1 if used == 0 else 0
        if idle_ticks > idle_limit and next_arrival >= len(pending):
            # Nothing has run for two horizons (plus a budget period) and nothing else will
            # arrive (e.g. the budget is spent for good): stop; the jobs left are reported
            # unfinished.
            break
        # Event-driven: apply slot one until the slot ends, a job arrives or a job finishes,
        # whichever comes first, then re-plan. ElasticFlow's simulator merges the events of one
        # slot instead: with `elasticflow_events` every step is a whole slot.
        overheads: dict[str, float] | None = None
        eventful = ef_event or any(first[j] != states[j].current_gpus for j in active)
        if ef_overhead is not None and eventful:
            overheads = ef_overhead.event([(j, first[j]) for j in active if first[j] > 0])
        moves: dict[str, tuple[int, float, bool]] = {}
        runs: list[tuple[float, float]] = []  # (real power_w, s until it finishes) per running job
        step_s = slot_s
        if next_arrival < len(pending) and (not config.elasticflow_events or not eventful):
            # ElasticFlow merges the events of the slot after an event into one; after a step
            # with no event (no arrival, completion or count change) the chain is broken, and the
            # next arrival is an event of its own at its time, as on an idle cluster. Aligned to
            # the step grid instead, a busy replay merged an arrival with those of the next
            # second, which an idle one admitted alone (cluster06[:20], 60 s, `f9d6d733`).
            step_s = min(step_s, max(pending[next_arrival].submission_s - now, 1.0))
        for job_id in active:
            state = states[job_id]
            gpus = first[job_id]
            # A job placement moved to another node at the same count switches too.
            moved = placer is not None and job_id in placer.moved
            changed = (gpus != state.current_gpus or moved) and gpus > 0 and state.started
            # A switch cut short by an event still owes the rest of its stall at the next one.
            switch = (
                _switch_stall_s(
                    config, state, gpus, placer.switches.get(job_id) if placer else None
                )
                if changed
                else (state.stall_s if gpus > 0 else 0.0)
            )
            if overheads is not None:
                # ElasticFlow's overhead instead of the per-change stall: each event sets it
                # anew (ElasticFlow drops what the last one left unpaid); between events (no
                # count changes then) the rest carries on as above.
                switch = overheads.get(job_id, 0.0)
            moves[job_id] = (gpus, switch, changed)
            if gpus > 0:
                k = state.tables.allowed_gpus.index(gpus)
                need_s = switch + state.remaining_samples / state.tables.throughput_samples_per_s[k]
                runs.append((state.tables.power_w[k], need_s))
                if not config.elasticflow_events:
                    step_s = min(step_s, need_s)
        step_s = max(step_s, 1e-3)
        if watchdog is None and config.ideal_watchdog:
            # The ideal budget watchdog: real power (not the plan's model of it) reaching the
            # period's budget stops the step there, and the next plan sees the budget spent.
            cut_s = budget_cut_s(clock, periods, spent_kg, now, step_s, runs)
            if cut_s < step_s:
                budget_cuts += 1
                step_s = max(cut_s, 1e-3)
        elif watchdog is not None:
            # The service's watchdog as it runs: checks, telemetry lag, a tick's latency.
            current = _current_period(periods, now)
            step_s = watchdog.step_s(
                plan,
                None if current is None else periods[current],
                0.0 if current is None else spent_kg[current],
                now,
                step_s,
                runs,
            )
            step_s = max(step_s, 1e-3)
        ran: list[tuple[float, float]] = []  # (real power_w, s it ran) per running job
        for job_id in list(active):
            state = states[job_id]
            gpus, switch, changed = moves[job_id]
            if changed:
                state.changes += 1
            state.current_gpus = gpus
            state.stall_s = max(0.0, switch - step_s) if gpus > 0 else 0.0
            if gpus == 0:
                continue
            state.started = True
            k = state.tables.allowed_gpus.index(gpus)
            rate = state.tables.throughput_samples_per_s[k]
            power_w = state.tables.power_w[k]
            need_s = switch + state.remaining_samples / rate
            run_s = min(step_s, need_s)
            if need_s <= step_s + 1e-6:
                state.remaining_samples = 0.0
                state.finish_s = now + need_s
                active.remove(job_id)
                completed_in_step = True
            else:
                state.remaining_samples -= rate * max(0.0, step_s - switch)
            # GPUs draw power during the switch too (memory traffic, not idle).
            kg = power_w * clock.kg_per_w(now, now + run_s)
            state.energy_kwh += facility_energy_kwh(energy_kwh(power_w, run_s), config.pue)
            state.emissions_kg += kg
            busy_gpu_s += gpus * run_s
            last_activity_s = max(last_activity_s, now + run_s)
            _charge(periods, spent_kg, now, run_s, kg)
            ran.append((power_w, run_s))
        if watchdog is not None:
            watchdog.ran(now, ran)
        now += step_s
        if progress is not None:
            progress(min(1.0, (now - start_s) / run_span_s))
    if progress is not None:
        progress(1.0)
    report = _report(
        config,
        jobs,
        states,
        periods,
        periods_in_span,
        spent_kg,
        solver_times,
        busy_gpu_s,
        start_s,
        last_activity_s,
        ticks,
        max(now, last_activity_s),
        budget_cuts if watchdog is None else watchdog.wakes,
    )
    return replace(report, plans_carried=plans_carried)


def run_budget_periods(
    config: SimulationConfig, jobs: list[TraceJob]
) -> tuple[float, float, list[BudgetWindow]]:
    """(start_s, span_s, budget periods) of a replay of `jobs`: the trace's span sets the periods."""
    start_s = jobs[0].submission_s
    last_s = max(
        max(j.submission_s, j.deadline_s or 0.0, j.submission_s + j.duration_s) for j in jobs
    )
    span_s = max(last_s - start_s, config.slot_s)
    return start_s, span_s, _budget_periods(config, start_s, span_s)


def _budget_periods(config: SimulationConfig, start_s: float, span_s: float) -> list[BudgetWindow]:
    """(start_s, end_s, budget_kg) per period in trace seconds; empty when unlimited."""
    if config.budget_kg is None:
        return []
    if config.budget_period == "run":
        return [BudgetWindow(start_s, math.inf, config.budget_kg)]
    length = PERIOD_S[config.budget_period]
    count = max(1, math.ceil(span_s / length))
    share = config.budget_kg / count
    return [
        BudgetWindow(start_s + i * length, start_s + (i + 1) * length, share) for i in range(count)
    ]


def _allowance(
    config: SimulationConfig,
    periods: list[BudgetWindow],
    periods_in_span: int,
    end_s: float,
) -> tuple[float | None, int]:
    """(total kg the reached periods allowed, periods after the span that work ran into)."""
    if config.budget_kg is None:
        return None, 0
    extra = periods[periods_in_span:]
    reached = [w.budget_kg for w in extra if w.start_s < end_s - 1e-9]
    return config.budget_kg + sum(reached), len(reached)


def _extend_periods(
    config: SimulationConfig,
    periods: list[BudgetWindow],
    spent: list[float],
    share_kg: float,
    until_s: float,
) -> None:
    """Past the trace's span each further period gets the same share, so work left over
    finishes at the same carbon rate instead of stalling on a spent last period."""
    if not periods or not math.isfinite(periods[-1].end_s):
        return
    length = PERIOD_S[config.budget_period]
    while periods[-1].end_s < until_s:
        begin = periods[-1].end_s
        periods.append(BudgetWindow(begin, begin + length, share_kg))
        spent.append(0.0)


def _charge(
    periods: list[BudgetWindow],
    spent: list[float],
    at_s: float,
    run_s: float,
    kg: float,
) -> None:
    for i, window in enumerate(periods):
        overlap = min(window.end_s, at_s + run_s) - max(window.start_s, at_s)
        if overlap > 0 and run_s > 0:
            spent[i] += kg * overlap / run_s


def _current_period(periods: list[BudgetWindow], now: float) -> int | None:
    """Index of the budget period that holds `now` (None: unlimited)."""
    return next(
        (i for i, w in enumerate(periods) if w.start_s <= now < w.end_s and w.end_s > w.start_s),
        None,
    )


def budget_cut_s(
    clock: CarbonClock,
    periods: list[BudgetWindow],
    spent_kg: list[float],
    now: float,
    step_s: float,
    runs: list[tuple[float, float]],
) -> float:
    """How long a step from `now` may last before its real spend exceeds the current period's budget.

    `runs` holds (power_w, need_s) per running job: it draws power_w until it finishes need_s
    from now. Returns `step_s` when the whole step fits, else the cut: at the period's end when
    only the part charged across it overspends (charged by time share, as `_charge` does), or
    the moment the spend reaches the budget (bisection: spend grows with time inside a period).
    """
    current = _current_period(periods, now)
    if current is None or not runs:
        return step_s
    end, share_kg = periods[current].end_s, periods[current].budget_kg
    left_kg = share_kg - spent_kg[current]

    def charged_kg(span_s: float) -> float:
        total = 0.0
        for power_w, need_s in runs:
            run_s = min(span_s, need_s)
            if run_s <= 0:
                continue
            overlap_s = min(end, now + run_s) - now
            total += power_w * clock.kg_per_w(now, now + run_s) * overlap_s / run_s
        return total

    # A relative tolerance: spend equal to the budget up to rounding is not an overspend.
    tolerance_kg = 1e-9 * max(share_kg, 1e-9)
    if charged_kg(step_s) <= left_kg + tolerance_kg:
        return step_s
    inside_s = min(step_s, end - now)
    if charged_kg(inside_s) <= left_kg + tolerance_kg:
        return inside_s
    lo, hi = 0.0, inside_s
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if charged_kg(mid) <= left_kg:
            lo = mid
        else:
            hi = mid
    return lo


def _admit_batch(
    config: SimulationConfig,
    policy: Callable[..., AllocationPlan],
    clock: CarbonClock,
    states: dict[str, _JobState],
    active: list[str],
    now: float,
    periods: list[BudgetWindow],
    spent_kg: list[float],
    batch: list[str],
    previous: AllocationPlan | None = None,
    placer: NodePlacer | None = None,
) -> AllocationPlan | None:
    """Admit the deadline jobs of `batch` together or not at all (ElasticFlow's admission).

    Returns the plan that admitted them (None when they were turned away).
    """
    problem = _problem(config, clock, states, active, now, periods, spent_kg)
    limit_s = config.time_limit_s / 2
    met_before: set[str] = set()
    crowded_before: set[str] = set()
    base = None
    if problem.jobs:
        # Warm from the plan in force, and its kept deadlines are promises too (as in `admit`).
        base = policy(problem, previous=previous, time_limit_s=limit_s, seed=config.seed)
        met_before = {k for k, v in base.deadline_met.items() if v}
        if previous is not None:
            met_before |= {k for k, v in previous.deadline_met.items() if v and k in active}
        crowded_before = set(after_horizon_overcommitted(problem, base.gpus))
    knobs = _knobs(config, periods)
    specs = [plan_job(_plannable(states[j], now), knobs) for j in batch]
    trial = replace(problem, jobs=(*problem.jobs, *specs))
    # Seeded as in `admit`: the plan in force (else the base plan) with the batch on the GPUs it
    # leaves, the answer where it keeps every deadline and the solve's plan does not.
    seeded = seed_for(trial, (previous, base), batch, met_before)
    plan = policy(trial, previous=seeded or previous, time_limit_s=limit_s, seed=config.seed)
    if seeded is not None and not all(
        plan.deadline_met.get(k, False) for k in (*batch, *met_before)
    ):
        plan = seeded
    # After the horizon the plan lets each job run alone at full speed: together they must fit.
    crowded = set(after_horizon_overcommitted(trial, plan.gpus)) - crowded_before
    late = [j for j in batch if not plan.deadline_met.get(j, False) or j in crowded]
    broken = [k for k in met_before if not plan.deadline_met.get(k, False) or k in crowded]
    if placer is not None and not late and not broken:
        # Promised only if the plan keeps them once placed on the nodes.
        lost = placer.lost_deadlines(trial, plan, set(batch), states)
        late = [j for j in batch if j in lost]
        broken = [k for k in lost if k not in batch]
    admitted = False
    for job_id in batch:
        state = states[job_id]
        state.guaranteed = not late and not broken
        state.admitted = state.guaranteed or config.best_effort or state.trace.best_effort
        if not state.admitted:
            why = (
                f"no plan meets the deadlines of {', '.join(late[:3])}"
                if late
                else f"it would break the deadlines of admitted jobs {', '.join(broken[:3])}"
            )
            state.reject_reason = f"rejected with its arrival batch: {why}"
            continue
        active.append(job_id)
        admitted = True
    return plan if admitted else None


def _new_state(
    job: TraceJob,
    profiles: dict[str, ScalingProfile],
    capacity: int,
    config: SimulationConfig,
    rng: np.random.Generator,
) -> _JobState:
    tables = job_tables(job, profiles, capacity)
    seen = tables
    if config.model_error > 0:
        thr_err = float(np.clip(rng.normal(1.0, config.model_error), 0.2, 5.0))
        pw_err = float(np.clip(rng.normal(1.0, config.model_error), 0.2, 5.0))
        seen = JobTables(
            tables.allowed_gpus,
            tuple(v * thr_err for v in tables.throughput_samples_per_s),
            tuple(v * pw_err for v in tables.power_w),
        )
    return _JobState(trace=job, tables=tables, seen=seen, remaining_samples=job.total_samples)


def _plannable(state: _JobState, now: float) -> PlannableJob:
    """What the policy believes of a job at `now` (a deadline only while it is guaranteed)."""
    job = state.trace
    remaining = state.remaining_samples
    if state.stall_s > 0 and state.current_gpus > 0:
        # The rest of a switch cut short by an event is owed at the next step: as work at the
        # count it runs at, so plans count it.
        k = state.seen.allowed_gpus.index(state.current_gpus)
        remaining += state.stall_s * state.seen.throughput_samples_per_s[k]
    return PlannableJob(
        job_id=job.job_id,
        allowed_gpus=state.seen.allowed_gpus,
        throughput_samples_per_s=state.seen.throughput_samples_per_s,
        power_w=state.seen.power_w,
        remaining_samples=remaining,
        deadline_s=(
            job.deadline_s - now if job.deadline_s is not None and state.guaranteed else None
        ),
        current_gpus=state.current_gpus,
        requested_gpus=job.num_gpu,
        started=state.started,
    )


def _knobs(config: SimulationConfig, periods: list[BudgetWindow]) -> ProblemKnobs:
    return ProblemKnobs(
        budget_mode=BudgetMode.HARD if periods else BudgetMode.SOFT,
        carbon_price_s_per_kg=config.carbon_price_s_per_kg,
        # A change stalls the job for switch_s: that is what it costs in completion time.
        change_cost_s=config.switch_s,
        deadline_margin_s=config.margin_s,
        # Plans count the stalls (issue 23: a promise kept just in time was lost to them).
        switch_stall_s=config.switch_s,
    )


def _spec(state: _JobState, now: float, margin_s: float) -> JobSpec:
    """The solver's view of one job at `now`, its deadline `margin_s` early (the builder's rule)."""
    return plan_job(_plannable(state, now), ProblemKnobs(deadline_margin_s=margin_s))


def _snapshot(
    config: SimulationConfig,
    clock: CarbonClock,
    states: dict[str, _JobState],
    active: list[str],
    now: float,
    periods: list[BudgetWindow],
    spent_kg: list[float],
) -> ClusterSnapshot:
    """The replay's world at `now` as the policy sees it (forecast and model error applied)."""
    slots = config.horizon_slots
    slot_s = config.slot_s
    if config.forecast_error > 0:
        intensity = [
            seen_intensity(config, clock, now, t, hard=bool(periods)) for t in range(slots)
        ]
    else:
        intensity = [
            clock.mean_intensity(now + t * slot_s, now + (t + 1) * slot_s) for t in range(slots)
        ]
    horizon_end = now + slots * slot_s
    windows = tuple(
        BudgetWindow(
            start_s=w.start_s - now,
            end_s=(w.end_s if math.isfinite(w.end_s) else horizon_end + slot_s) - now,
            budget_kg=max(0.0, w.budget_kg - spent),
        )
        for w, spent in zip(periods, spent_kg, strict=True)
        if w.end_s > now and w.start_s < horizon_end
    )
    return ClusterSnapshot(
        start_at=clock.origin + timedelta(seconds=now),
        slot_s=slot_s,
        num_slots=slots,
        node_gpus=(config.gpus_per_node,) * config.num_nodes,
        intensity_g_per_kwh=tuple(intensity),
        jobs=tuple(_plannable(states[j], now) for j in active),
        budget_windows=windows,
        pue=config.pue,
    )


def seen_intensity(
    config: SimulationConfig, clock: CarbonClock, now: float, slot: int, *, hard: bool
) -> float:
    """The mean intensity the planner sees over one slot under forecast noise, raised under a
    hard budget to `forecast_quantile` (the slot about to run: `commit_quantile`).

    With `config.measured_now`, per trace hour the slot touches: the actual value in the hour
    running now (measured), the noisy forecast in later ones. Without (the earlier model): the
    slot's actual mean times one draw, keyed on the hour the slot starts in."""
    slot_s = config.slot_s
    start, end = now + slot * slot_s, now + (slot + 1) * slot_s
    if not config.measured_now:
        return _noisy(config, clock.mean_intensity(start, end), now, start, slot, hard=hard)
    now_hour = math.floor(now / 3600.0)
    total = 0.0
    cursor = start
    while cursor < end - 1e-9:
        piece_end = min(end, (math.floor(cursor / 3600.0) + 1) * 3600.0)
        value = clock.mean_intensity(cursor, piece_end)
        if math.floor(cursor / 3600.0) != now_hour:
            value = _noisy(config, value, now, cursor, slot, hard=hard)
        total += value * (piece_end - cursor)
        cursor = piece_end
    return total / slot_s


def _noisy(
    config: SimulationConfig, value: float, now: float, at: float, slot: int, *, hard: bool
) -> float:
    """`value` (the actual mean from trace time `at`) as forecast at `now`, with the quantile."""
    # Noise from a generator keyed on the trace hour: the same hour gets the same error whenever
    # it is forecast, so re-planning does not average the error away.
    hour = math.floor(at / 3600.0)
    draw = np.random.default_rng(hour + 7919 * config.seed).normal(0.0, 1.0)
    horizon_h = int((at - now) // 3600.0) + 1
    if config.forecast_noise == "flat":
        value = max(0.0, value * (1.0 + config.forecast_error * draw))
    else:
        value *= math.exp(-config.forecast_error * measured_log_std(horizon_h) * draw)
    if hard and config.forecast_quantile is not None:
        # A hard budget plans with the upper quantile (the service's rule, `planning.py`).
        quantile = config.forecast_quantile
        if slot == 0 and config.commit_quantile is not None:
            quantile = max(quantile, config.commit_quantile)
        value *= forecast_upper_factor(config, quantile, horizon_h)
    return value


# The flat noise never reaches the quantile's pole (a noise of 1 / z_q or more).
_MAX_UPPER_FACTOR = 20.0


def measured_log_std(horizon_h: int) -> float:
    """Std of ln(actual / forecast) of our forecaster at a horizon hour (1..24, later hours hold
    24 h): its measured 80th percentile (`PRIOR_UPPER_LOG_ERROR_Q80`) read as a normal spread."""
    index = min(max(horizon_h, 1), len(PRIOR_UPPER_LOG_ERROR_Q80)) - 1
    return PRIOR_UPPER_LOG_ERROR_Q80[index] / NormalDist().inv_cdf(PRIOR_QUANTILE)


def forecast_upper_factor(config: SimulationConfig, quantile: float, horizon_h: int = 1) -> float:
    """The `quantile` of actual / forecast under the replay's forecast noise at a horizon hour:
    actual exceeds forecast x this factor with probability 1 - quantile; floored at 1 (never plan
    a cleaner grid than forecast).

    Flat noise (forecast = actual x (1 + sigma Z)): P(actual > u x forecast) = P(1 + sigma Z < 1/u)
    = 1 - quantile gives u = 1 / (1 - sigma z_q). Measured noise: u = exp(sigma_h z_q)."""
    z = NormalDist().inv_cdf(quantile)
    if config.forecast_noise == "measured":
        return max(1.0, math.exp(config.forecast_error * measured_log_std(horizon_h) * z))
    below = 1.0 - config.forecast_error * z
    if below <= 1.0 / _MAX_UPPER_FACTOR:
        return _MAX_UPPER_FACTOR
    return max(1.0, 1.0 / below)


def _problem(
    config: SimulationConfig,
    clock: CarbonClock,
    states: dict[str, _JobState],
    active: list[str],
    now: float,
    periods: list[BudgetWindow],
    spent_kg: list[float],
) -> AllocationProblem:
    snapshot = _snapshot(config, clock, states, active, now, periods, spent_kg)
    return build_problem(snapshot, _knobs(config, periods))


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else 0.0


def _report(
    config: SimulationConfig,
    jobs: list[TraceJob],
    states: dict[str, _JobState],
    periods: list[BudgetWindow],
    periods_in_span: int,
    spent_kg: list[float],
    solver_times: list[float],
    busy_gpu_s: float,
    start_s: float,
    end_s: float,
    ticks: int,
    stop_s: float,
    budget_cuts: int,
) -> SimulationReport:
    outcomes = []
    for job in jobs:
        state = states.get(job.job_id)
        if state is None:
            continue
        jct = None if state.finish_s is None else state.finish_s - job.submission_s
        met = None
        lateness = None
        promised = job.deadline_s is not None and state.admitted and state.guaranteed
        if job.deadline_s is not None:
            met = (
                state.admitted
                and state.finish_s is not None
                and state.finish_s <= job.deadline_s + 1e-6
            )
            if promised:
                end = stop_s if state.finish_s is None else state.finish_s
                lateness = 0.0 if met else max(0.0, end - job.deadline_s)
        outcomes.append(
            JobOutcome(
                job_id=job.job_id,
                admitted=state.admitted,
                finish_s=state.finish_s,
                jct_s=jct,
                deadline_met=met,
                gpu_changes=state.changes,
                energy_kwh=state.energy_kwh,
                emissions_kg=state.emissions_kg,
                reject_reason=state.reject_reason,
                guaranteed=promised,
                lateness_s=lateness,
                placement_lowered=state.lowered,
                placement_reason=state.lowered_reason,
                nodes_max=state.nodes_max,
                placement_moves=state.moves,
            )
        )
    broken = [o for o in outcomes if o.guaranteed and not o.deadline_met]
    lateness_s = [o.lateness_s or 0.0 for o in broken]
    jcts = [o.jct_s for o in outcomes if o.jct_s is not None]
    by_id = {job.job_id: job for job in jobs}
    left = [o for o in outcomes if o.admitted and o.finish_s is None]
    jcts_all = jcts + [max(0.0, stop_s - by_id[o.job_id].submission_s) for o in left]
    with_deadline = [o for o in outcomes if o.deadline_met is not None]
    overshoot = [max(0.0, spent - w.budget_kg) for w, spent in zip(periods, spent_kg, strict=True)]
    makespan = max(end_s - start_s, config.slot_s)
    allowance_kg, extra_periods = _allowance(config, periods, periods_in_span, end_s)
    return SimulationReport(
        policy=config.policy,
        jobs=len(outcomes),
        admitted=sum(1 for o in outcomes if o.admitted),
        finished=len(jcts),
        unfinished=len(left),
        deadline_jobs=len(with_deadline),
        deadline_met_ratio=(
            sum(1 for o in with_deadline if o.deadline_met) / len(with_deadline)
            if with_deadline
            else 1.0
        ),
        avg_jct_s=statistics.fmean(jcts) if jcts else None,
        p95_jct_s=_percentile(jcts, 95) if jcts else None,
        avg_jct_all_s=statistics.fmean(jcts_all) if jcts_all else None,
        energy_kwh=sum(o.energy_kwh for o in outcomes),
        emissions_kg=sum(o.emissions_kg for o in outcomes),
        budget_kg=config.budget_kg,
        budget_allowance_kg=allowance_kg,
        budget_periods_after_span=extra_periods,
        budget_violations=sum(1 for x in overshoot if x > 1e-6),
        budget_overshoot_kg=sum(overshoot),
        budget_cuts=budget_cuts,
        gpu_utilisation=busy_gpu_s / (config.capacity_gpus * makespan),
        gpu_changes=sum(o.gpu_changes for o in outcomes),
        ticks=ticks,
        solver_s_mean=statistics.fmean(solver_times) if solver_times else 0.0,
        solver_s_p95=_percentile(solver_times, 95),
        solver_s_max=max(solver_times, default=0.0),
        makespan_s=makespan,
        admitted_missed=len(broken),
        admitted_lateness_s={"sum": sum(lateness_s), "max": max(lateness_s, default=0.0)},
        placement=placement_label(config),
        switch_cost=switch_cost_label(config),
        placement_lowered=sum(o.placement_lowered for o in outcomes),
        placement_lowered_jobs=sum(1 for o in outcomes if o.placement_lowered),
        admitted_missed_lowered=sum(1 for o in broken if o.placement_lowered),
        jobs_spanning_nodes=sum(1 for o in outcomes if o.nodes_max > 1),
        placement_moves=sum(o.placement_moves for o in outcomes),
        outcomes=outcomes,
    )
