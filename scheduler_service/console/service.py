"""What each console page shows, built from the console's read queries (no SQL and no HTML here)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy.orm import Session

from scheduler_service.auth.service import Principal
from scheduler_service.budget.periods import period_containing
from scheduler_service.console.repository import (
    ConsoleRepository,
    EventRow,
    GpuUseRow,
    LayoutChange,
)
from scheduler_service.db.models import (
    Allocation,
    CarbonIntensitySample,
    Job,
    JobEvent,
    LedgerEntry,
    Node,
    Plan,
    TelemetrySample,
)
from scheduler_service.jobs.states import ACTIVE_STATES, TERMINAL_STATES, JobState
from scheduler_service.settings import GreenflowConfig

# How many of a job's newest telemetry samples its current throughput is averaged over.
RATE_WINDOW_SAMPLES = 5
# Jobs whose completion is projected for their deadline (not yet finished).
UNFINISHED_STATES = tuple(
    s.value for s in JobState if s not in TERMINAL_STATES and s is not JobState.PENDING
)
HISTORY = timedelta(hours=24)


# Pure helpers ---------------------------------------------------------------------------------


def unix_s(at: datetime) -> float:
    """Seconds since the Unix epoch (what the charts plot on their x axis)."""
    return at.timestamp()


def job_total_samples(job: Job) -> int | None:
    """A job's work in samples, whichever way it was given."""
    if job.total_samples is not None:
        return job.total_samples
    if job.total_steps is not None:
        return job.total_steps * job.global_batch_size
    return None


@dataclass(frozen=True)
class Projection:
    """When a job is expected to finish at its current rate, and how that compares with its deadline."""

    status: Literal["finished", "on track", "at risk", "missed", "unknown"]
    samples_per_s: float | None
    completion_at: datetime | None
    slack_s: float | None
    note: str


def project_completion(job: Job, recent: Sequence[TelemetrySample], now: datetime) -> Projection:
    """Linear projection of a job's completion from its recent throughput."""
    state = JobState(job.state)
    if state in TERMINAL_STATES:
        return Projection(
            "missed" if state is JobState.DEADLINE_MISSED else "finished",
            None,
            job.finished_at,
            None,
            f"job is {state.value}",
        )
    rates = [s.samples_per_s for s in recent if s.samples_per_s > 0]
    rate = sum(rates) / len(rates) if rates else None
    total = job_total_samples(job)
    if rate is None or total is None or state not in ACTIVE_STATES:
        why = "not running" if state not in ACTIVE_STATES else "no throughput measured yet"
        status: Literal["missed", "unknown"] = (
            "missed" if job.deadline_at is not None and job.deadline_at < now else "unknown"
        )
        return Projection(status, rate, None, None, why)
    remaining = max(total - job.samples_done, 0)
    completion = now + timedelta(seconds=remaining / rate)
    if job.deadline_at is None:
        return Projection("on track", rate, completion, None, "no deadline")
    slack_s = (job.deadline_at - completion).total_seconds()
    if slack_s >= 0:
        return Projection("on track", rate, completion, slack_s, "finishes before its deadline")
    return Projection(
        "at risk", rate, completion, slack_s, "finishes after its deadline at the current rate"
    )


def dedupe_by_time(samples: Iterable[CarbonIntensitySample]) -> list[tuple[datetime, float]]:
    """One intensity per time (the one fetched last), in time order."""
    by_time: dict[datetime, float] = {}
    for sample in samples:  # ordered by (at, fetched_at): later fetches overwrite
        by_time[sample.at] = sample.intensity_g_per_kwh
    return sorted(by_time.items())


def gpus_in_use_series(
    rows: Iterable[GpuUseRow], *, since: datetime, until: datetime, bucket_s: int
) -> list[tuple[datetime, int]]:
    """GPUs in use per clock-aligned time bucket: the sum over jobs of the most each reported in it."""
    first = math.floor(since.timestamp() / bucket_s)
    last = math.floor(until.timestamp() / bucket_s)
    per_bucket: dict[int, dict[int, int]] = defaultdict(dict)
    for row in rows:
        jobs = per_bucket[row.bucket]
        jobs[row.job_id] = max(jobs.get(row.job_id, 0), row.gpus)
    return [
        (
            datetime.fromtimestamp(i * bucket_s, UTC),
            sum(per_bucket[i].values()) if i in per_bucket else 0,
        )
        for i in range(first, last + 1)
        # The bucket still in progress counts only once something has reported in it.
        if i < last or i in per_bucket
    ]


@dataclass(frozen=True)
class Segment:
    """A stretch of time in which a job ran with one GPU count and layout."""

    start: datetime
    end: datetime
    gpus: int
    layout: str | None


def layout_segments(changes: Sequence[LayoutChange], last_at: datetime | None) -> list[Segment]:
    """Stretches of one GPU count and layout: each change starts one, the next change ends it."""
    starts = [c.at - timedelta(seconds=c.interval_s) for c in changes]
    segments = []
    for index, change in enumerate(changes):
        end = starts[index + 1] if index + 1 < len(changes) else (last_at or change.at)
        segments.append(Segment(starts[index], end, change.gpus, change.layout))
    return segments


# Charts of one job plot at most about this many points, however long it has run.
JOB_CHART_POINTS = 600


def job_bucket_s(first_at: datetime | None, last_at: datetime | None) -> int:
    """Bucket width for a job's charts: whole seconds, so that its history fits JOB_CHART_POINTS."""
    if first_at is None or last_at is None:
        return 1
    return max(1, math.ceil((last_at - first_at).total_seconds() / JOB_CHART_POINTS))


@dataclass(frozen=True)
class PlanInfo:
    """The newest plan the control loop made, as the console summarises it."""

    created_at: datetime
    start_at: datetime
    slot_s: float
    slots: int
    policy: str
    status: str
    energy_kwh: float
    emissions_kg: float
    forecast_degraded: bool
    deadline_misses: dict[str, str]


def plan_info(plan: Plan, *, visible_job_ids: set[str] | None) -> PlanInfo:
    """A plan's summary; deadline misses only of the jobs the caller may see (None: all)."""
    misses = {
        job_id: reason
        for job_id, reason in (plan.deadline_misses or {}).items()
        if visible_job_ids is None or job_id in visible_job_ids
    }
    return PlanInfo(
        created_at=plan.created_at,
        start_at=plan.start_at,
        slot_s=plan.slot_s,
        slots=len(plan.slots),
        policy=plan.policy,
        status=plan.status,
        energy_kwh=plan.energy_kwh,
        emissions_kg=plan.emissions_kg,
        forecast_degraded=plan.forecast_degraded,
        deadline_misses=misses,
    )


def planned_gpus(plan: Plan, job_id: str | None = None) -> list[tuple[datetime, float]]:
    """GPUs the plan gives per slot (one job's, or all jobs' summed), ending with the horizon."""
    rows = plan.gpus_by_job or {}
    counts = [rows.get(job_id, [])] if job_id is not None else list(rows.values())
    n_slots = max([len(plan.slots), *(len(c) for c in counts)])
    if job_id is not None:
        # One job: stop after its last planned GPU rather than running to the horizon at zero.
        per_slot = counts[0]
        n_slots = next((i + 1 for i in range(len(per_slot) - 1, -1, -1) if per_slot[i] > 0), 0)
        n_slots = min(n_slots + 1, len(per_slot))
    totals = [0.0] * n_slots
    for per_slot in counts:
        for index, gpus in enumerate(per_slot[:n_slots]):
            totals[index] += gpus
    points = [
        (plan.start_at + timedelta(seconds=i * plan.slot_s), totals[i]) for i in range(n_slots)
    ]
    if n_slots:
        # Repeat the last value at the horizon so the last slot's step has its full width.
        points.append((plan.start_at + timedelta(seconds=n_slots * plan.slot_s), totals[-1]))
    return points


@dataclass
class ChartSeries:
    """One line of a chart (values aligned with the chart's x)."""

    label: str
    unit: str
    values: list[float | None]
    scale: str
    color: str
    step: bool = False
    dash: bool = False
    points_only: bool = False


@dataclass
class Chart:
    """Data for one uPlot chart: x in Unix seconds, series, axes and vertical marks."""

    x: list[float]
    series: list[ChartSeries]
    scales: dict[str, dict[str, Any]]
    marks: list[dict[str, Any]] = field(default_factory=list)
    # A sparkline: no legend, no axis titles.
    compact: bool = False

    @property
    def empty(self) -> bool:
        """True when there is nothing to draw."""
        return not self.x or all(v is None for s in self.series for v in s.values)

    def as_json(self) -> dict[str, Any]:
        """The chart as the console's JavaScript reads it."""
        return {
            "x": self.x,
            "series": [s.__dict__ for s in self.series],
            "scales": self.scales,
            "marks": self.marks,
            "compact": self.compact,
        }


def aligned_chart(
    lines: Sequence[tuple[ChartSeries, Sequence[tuple[datetime, float]]]],
    scales: dict[str, dict[str, Any]],
    marks: list[dict[str, Any]] | None = None,
    *,
    compact: bool = False,
) -> Chart:
    """A chart whose series, given as (time, value) lists, share one x axis (gaps are None)."""
    xs = sorted({unix_s(at) for _, points in lines for at, _ in points})
    index = {x: i for i, x in enumerate(xs)}
    series = []
    for template, points in lines:
        values: list[float | None] = [None] * len(xs)
        for at, value in points:
            values[index[unix_s(at)]] = value
        template.values = values
        series.append(template)
    return Chart(x=xs, series=series, scales=scales, marks=marks or [], compact=compact)


# Page models ----------------------------------------------------------------------------------


PERIOD_NAMES = {"day": "today", "week": "this week", "month": "this month"}


@dataclass(frozen=True)
class BudgetView:
    """The carbon budget of the current period and how much of it is spent."""

    period: str
    enforcement: str
    start: datetime
    end: datetime
    limit_kg: float
    spent_kg: float
    energy_kwh: float
    burn_down: Chart

    @property
    def period_name(self) -> str:
        """`today`, `this week` or `this month`."""
        return PERIOD_NAMES.get(self.period, f"this {self.period}")

    @property
    def remaining_kg(self) -> float:
        """Budget left (negative when overspent)."""
        return self.limit_kg - self.spent_kg

    @property
    def spent_pct(self) -> float:
        """Share of the budget spent, in percent."""
        return 100.0 * self.spent_kg / self.limit_kg if self.limit_kg > 0 else 0.0


@dataclass(frozen=True)
class IntensityView:
    """The current carbon intensity and its trend over the last hours."""

    region: str
    latest_g_per_kwh: float | None
    latest_at: datetime | None
    source: str | None
    change_pct_1h: float | None
    sparkline: Chart


@dataclass(frozen=True)
class JobRisk:
    """A job with its completion projection."""

    job: Job
    projection: Projection
    # Why the current plan cannot meet the deadline (None when it can, or there is no plan).
    plan_reason: str | None = None


@dataclass(frozen=True)
class Overview:
    """Everything the overview page shows."""

    gpus_total: int
    gpus_used: int
    jobs_by_state: dict[str, int]
    intensity: IntensityView
    budget: BudgetView
    events: list[EventRow]
    risks: list[JobRisk]

    @property
    def gpus_free(self) -> int:
        """GPUs on ready nodes that hold no job."""
        return self.gpus_total - self.gpus_used


def _owner_filter(principal: Principal) -> str | None:
    return None if principal.is_operator else principal.name


def budget_view(repo: ConsoleRepository, config: GreenflowConfig, now: datetime) -> BudgetView:
    """The current period's budget, spend and burn-down chart."""
    period = period_containing(now, config.budget.period)
    start, end = period.start_at, period.end_at
    entries: list[LedgerEntry] = repo.ledger_in_period(period_start=start)
    limit_kg = config.budget.limit_kg_co2e
    remaining: list[tuple[datetime, float]] = [(start, limit_kg)]
    spent = 0.0
    energy = 0.0
    for entry in entries:
        spent += entry.emissions_kg
        energy += entry.energy_kwh
        remaining.append((entry.interval_end, limit_kg - spent))
    pace = [(start, limit_kg), (end, 0.0)]
    chart = aligned_chart(
        [
            (ChartSeries("Budget left", "kg CO₂e", [], "kg", "--chart-1", step=True), remaining),
            (ChartSeries("Even pace", "kg CO₂e", [], "kg", "--chart-muted", dash=True), pace),
        ],
        {"kg": {"label": "kg CO₂e left"}},
        marks=[{"x": unix_s(now), "label": "now"}],
    )
    return BudgetView(
        period=config.budget.period,
        enforcement=config.budget.enforcement,
        start=start,
        end=end,
        limit_kg=limit_kg,
        spent_kg=spent,
        energy_kwh=energy,
        burn_down=chart,
    )


def intensity_view(
    repo: ConsoleRepository, config: GreenflowConfig, now: datetime
) -> IntensityView:
    """Latest intensity of the configured region, its change over an hour, and a 24 h sparkline."""
    region = config.carbon.region
    points = dedupe_by_time(repo.intensity_samples(region=region, since=now - HISTORY, until=now))
    latest = repo.latest_intensity(region=region)
    change: float | None = None
    if latest is not None:
        earlier = [v for at, v in points if at <= latest.at - timedelta(hours=1)]
        if earlier and earlier[-1] > 0:
            change = 100.0 * (latest.intensity_g_per_kwh - earlier[-1]) / earlier[-1]
    chart = aligned_chart(
        [(ChartSeries("Intensity", "g CO₂e/kWh", [], "g", "--chart-2"), points)],
        {"g": {"label": "g CO₂e/kWh"}},
        compact=True,
    )
    return IntensityView(
        region=region,
        latest_g_per_kwh=latest.intensity_g_per_kwh if latest else None,
        latest_at=latest.at if latest else None,
        source=latest.source if latest else None,
        change_pct_1h=change,
        sparkline=chart,
    )


def overview(
    session: Session, principal: Principal, config: GreenflowConfig, now: datetime
) -> Overview:
    """The overview page for this caller."""
    repo = ConsoleRepository(session)
    owner = _owner_filter(principal)
    total, used = repo.gpu_counts()
    counts = repo.count_by_state()
    plan = repo.latest_plan()
    misses = (plan.deadline_misses or {}) if plan is not None else {}
    risks = []
    for job in repo.jobs_in_states(UNFINISHED_STATES, owner=owner):
        if job.deadline_at is None:
            continue
        projection = project_completion(
            job, repo.recent_telemetry(job.id, limit=RATE_WINDOW_SAMPLES), now
        )
        plan_reason = misses.get(str(job.id))
        if projection.status in ("at risk", "missed") or plan_reason is not None:
            risks.append(JobRisk(job, projection, plan_reason))
    return Overview(
        gpus_total=total,
        gpus_used=used,
        jobs_by_state={s.value: counts.get(s.value, 0) for s in JobState},
        intensity=intensity_view(repo, config, now),
        budget=budget_view(repo, config, now),
        events=repo.recent_events(kinds=None, owner=owner, limit=15, skip_submissions=True),
        risks=risks,
    )


@dataclass(frozen=True)
class ForecastInfo:
    """Where the newest forecast came from and whether it is degraded."""

    source: str
    fetched_at: datetime
    degraded: bool
    degraded_reason: str | None
    points: int


@dataclass(frozen=True)
class PeriodRow:
    """One budget period's emissions against the configured limit."""

    start: datetime
    end: datetime
    emissions_kg: float
    energy_kwh: float
    limit_kg: float
    current: bool

    @property
    def used_pct(self) -> float:
        """Share of the limit used, in percent."""
        return 100.0 * self.emissions_kg / self.limit_kg if self.limit_kg > 0 else 0.0


@dataclass(frozen=True)
class CarbonPage:
    """Everything the carbon page shows."""

    region: str
    chart: Chart
    forecast: ForecastInfo | None
    plan: PlanInfo | None
    budget: BudgetView
    periods: list[PeriodRow]
    bucket_s: float


def _forecast_points(points: Iterable[dict[str, Any]]) -> list[tuple[datetime, float]]:
    parsed = []
    for point in points:
        try:
            at = datetime.fromisoformat(str(point["at"]))
            value = float(point["intensity_g_per_kwh"])
        except (KeyError, TypeError, ValueError):
            continue  # a malformed point is skipped, not fatal for the page
        parsed.append((at if at.tzinfo else at.replace(tzinfo=UTC), value))
    return sorted(parsed)


def carbon_page(
    session: Session, principal: Principal, config: GreenflowConfig, now: datetime
) -> CarbonPage:
    """Intensity history and forecast with GPUs in use overlaid, and the budget periods."""
    repo = ConsoleRepository(session)
    region = config.carbon.region
    since = now - HISTORY
    history = dedupe_by_time(repo.intensity_samples(region=region, since=since, until=now))
    record = repo.latest_forecast(region=region)
    forecast = _forecast_points(record.points) if record is not None else []
    bucket_s = config.planner.slot_s
    gpus = gpus_in_use_series(
        repo.gpu_use(since=since, until=now, bucket_s=bucket_s),
        since=since,
        until=now,
        bucket_s=bucket_s,
    )
    plan = repo.latest_plan()
    lines = [
        (ChartSeries("Measured intensity", "g CO₂e/kWh", [], "g", "--chart-2"), history),
        (ChartSeries("Forecast", "g CO₂e/kWh", [], "g", "--chart-3", dash=True), forecast),
        (
            ChartSeries("GPUs in use", "GPUs", [], "gpus", "--chart-1", step=True),
            [(at, float(n)) for at, n in gpus],
        ),
    ]
    if plan is not None:
        lines.append(
            (
                ChartSeries("Planned GPUs", "GPUs", [], "gpus", "--chart-4", step=True, dash=True),
                planned_gpus(plan),
            )
        )
    visible = (
        None
        if principal.is_operator
        else {
            str(j.id)
            for j in repo.jobs_in_states([s.value for s in JobState], owner=principal.name)
        }
    )
    chart = aligned_chart(
        lines,
        {"g": {"label": "g CO₂e/kWh"}, "gpus": {"label": "GPUs", "side": "right"}},
        marks=[{"x": unix_s(now), "label": "now"}],
    )
    budget = budget_view(repo, config, now)
    periods = [
        PeriodRow(
            start=p.period_start,
            end=p.period_end,
            emissions_kg=p.emissions_kg,
            energy_kwh=p.energy_kwh,
            limit_kg=config.budget.limit_kg_co2e,
            current=p.period_start == budget.start,
        )
        for p in repo.period_totals(limit=14)
    ]
    info = (
        ForecastInfo(
            source=record.source,
            fetched_at=record.fetched_at,
            degraded=record.degraded,
            degraded_reason=record.degraded_reason,
            points=len(forecast),
        )
        if record is not None
        else None
    )
    return CarbonPage(
        region=region,
        chart=chart,
        forecast=info,
        plan=plan_info(plan, visible_job_ids=visible) if plan is not None else None,
        budget=budget,
        periods=periods,
        bucket_s=bucket_s,
    )


@dataclass(frozen=True)
class HotSwitch:
    """One hot switch of a job, read from its event."""

    event: JobEvent
    from_gpus: Any
    to_gpus: Any
    from_layout: Any
    to_layout: Any
    switch_s: Any


@dataclass(frozen=True)
class JobPage:
    """Everything a job's page shows."""

    job: Job
    total_samples: int | None
    events: list[JobEvent]
    hot_switches: list[HotSwitch]
    allocations: list[Allocation]
    segments: list[Segment]
    gpu_chart: Chart
    rate_chart: Chart
    energy_kwh: float
    emissions_kg: float
    latest_power_w: float | None
    power_source: str | None
    projection: Projection
    plan: PlanInfo | None
    plan_reason: str | None

    @property
    def progress_pct(self) -> float | None:
        """Share of the work done, in percent."""
        if not self.total_samples:
            return None
        return min(100.0, 100.0 * self.job.samples_done / self.total_samples)


def _detail(details: dict[str, Any] | None, *keys: str) -> Any:
    for key in keys:
        if details and key in details:
            return details[key]
    return None


def hot_switch_of(event: JobEvent, previous_layout: Any = None) -> HotSwitch:
    """The before/after of a hot-switch event (fields neither it nor `previous_layout` give are None)."""
    d = event.details
    return HotSwitch(
        event=event,
        from_gpus=_detail(d, "from_gpus", "old_gpus"),
        to_gpus=_detail(d, "to_gpus", "new_gpus", "gpus"),
        from_layout=_detail(d, "from_layout", "old_layout") or previous_layout,
        to_layout=_detail(d, "to_layout", "new_layout", "layout"),
        switch_s=_detail(d, "switch_s", "duration_s"),
    )


def hot_switches(events: Sequence[JobEvent]) -> list[HotSwitch]:
    """A job's hot switches in order; a switch's old layout defaults to the layout before it."""
    switches = []
    layout: Any = None
    for event in events:
        if event.kind == "hot_switch":
            switch = hot_switch_of(event, layout)
            switches.append(switch)
            layout = switch.to_layout
        elif event.kind == "allocation":
            layout = _detail(event.details, "to_layout", "layout") or layout
    return switches


def job_page(session: Session, job: Job, now: datetime) -> JobPage:
    """A visible job's spec, timeline, GPU/layout history, throughput, energy and projection."""
    repo = ConsoleRepository(session)
    events = repo.job_events(job.id)
    first_at, last_at = repo.telemetry_span(job.id)
    buckets = repo.telemetry_buckets(job.id, bucket_s=job_bucket_s(first_at, last_at))
    recent = repo.recent_telemetry(job.id, limit=RATE_WINDOW_SAMPLES)
    switches = hot_switches(events)
    plan = repo.latest_plan()
    marks = [
        {
            "x": unix_s(s.event.at),
            "label": f"{s.from_gpus if s.from_gpus is not None else '?'}→"
            f"{s.to_gpus if s.to_gpus is not None else '?'} GPUs",
        }
        for s in switches
    ]
    # A sample reports the GPUs of the interval that ends at `at`: plot it from the interval's start.
    gpu_points = [(b.first_at - timedelta(seconds=b.interval_s), float(b.gpus)) for b in buckets]
    gpu_lines = [(ChartSeries("GPUs", "GPUs", [], "gpus", "--chart-1", step=True), gpu_points)]
    planned = planned_gpus(plan, str(job.id)) if plan is not None else []
    if any(gpus > 0 for _, gpus in planned):
        gpu_lines.append(
            (
                ChartSeries("Planned", "GPUs", [], "gpus", "--chart-4", step=True, dash=True),
                planned,
            )
        )
        marks = [*marks, {"x": unix_s(now), "label": "now"}]
    gpu_chart = aligned_chart(gpu_lines, {"gpus": {"label": "GPUs", "min": 0}}, marks=marks)
    rate_chart = aligned_chart(
        [
            (
                ChartSeries("Throughput", "samples/s", [], "rate", "--chart-2"),
                [(b.last_at, b.samples_per_s) for b in buckets],
            ),
            (
                ChartSeries("Power", "W", [], "power", "--chart-3", dash=True),
                [(b.last_at, b.power_w) for b in buckets],
            ),
        ],
        {
            "rate": {"label": "samples/s", "min": 0},
            "power": {"label": "W", "side": "right", "min": 0},
        },
        marks=marks,
    )
    latest = recent[-1] if recent else None
    return JobPage(
        job=job,
        total_samples=job_total_samples(job),
        events=events,
        hot_switches=switches,
        allocations=repo.allocations(job.id),
        segments=layout_segments(repo.layout_changes(job.id), last_at),
        gpu_chart=gpu_chart,
        rate_chart=rate_chart,
        energy_kwh=repo.job_energy_kwh(job.id),
        emissions_kg=repo.job_emissions_kg(job.id),
        latest_power_w=latest.power_w if latest else None,
        power_source=latest.power_source if latest else None,
        projection=project_completion(job, recent, now),
        plan=plan_info(plan, visible_job_ids={str(job.id)}) if plan is not None else None,
        plan_reason=(plan.deadline_misses or {}).get(str(job.id)) if plan is not None else None,
    )


@dataclass(frozen=True)
class SlotView:
    """A GPU slot and the job on it (hidden from users when it is someone else's)."""

    index: int
    uuid: str | None
    memory_mb: int
    job_id: int | None
    job_name: str | None
    job_state: str | None
    visible: bool


@dataclass(frozen=True)
class NodeView:
    """A node, its health and its slots."""

    node: Node
    heartbeat_age_s: float | None
    health: Literal["healthy", "stale heartbeat", "no heartbeat yet", "not ready"]
    slots: list[SlotView]

    @property
    def used(self) -> int:
        """Slots holding a job."""
        return sum(1 for s in self.slots if s.job_id is not None)


def node_health(
    node: Node, now: datetime, timeout_s: float
) -> tuple[float | None, Literal["healthy", "stale heartbeat", "no heartbeat yet", "not ready"]]:
    """Heartbeat age in seconds and a one-word health for a node."""
    age = (now - node.last_heartbeat_at).total_seconds() if node.last_heartbeat_at else None
    if node.state != "ready":
        return age, "not ready"
    if age is None:
        return None, "no heartbeat yet"
    return age, "healthy" if age <= timeout_s else "stale heartbeat"


def nodes_page(
    session: Session, principal: Principal, config: GreenflowConfig, now: datetime
) -> list[NodeView]:
    """Every node with its slots; users see which slots are busy but only their own jobs' names."""
    repo = ConsoleRepository(session)
    nodes = repo.nodes_with_slots()
    job_ids = sorted({s.job_id for n in nodes for s in n.slots if s.job_id is not None})
    jobs = repo.jobs_by_ids(job_ids)
    views = []
    for node in nodes:
        age, health = node_health(node, now, config.cluster.heartbeat_timeout_s)
        slots = []
        for slot in node.slots:
            job = jobs.get(slot.job_id) if slot.job_id is not None else None
            visible = job is not None and (principal.is_operator or job.owner == principal.name)
            slots.append(
                SlotView(
                    index=slot.index,
                    uuid=slot.uuid,
                    memory_mb=slot.memory_mb,
                    job_id=slot.job_id,
                    job_name=job.name if job is not None and visible else None,
                    job_state=job.state if job is not None and visible else None,
                    visible=visible,
                )
            )
        views.append(NodeView(node=node, heartbeat_age_s=age, health=health, slots=slots))
    return views
