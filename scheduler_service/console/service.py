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
from scheduler_service.budget.ledger import period_clock, team_statuses
from scheduler_service.budget.periods import period_containing
from scheduler_service.budget.repository import LedgerRepository
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
)
from scheduler_service.dispatch.plans import padded
from scheduler_service.jobs.logs import LogSource, LogsUnavailable, fetch_chunk, fetch_curve
from scheduler_service.jobs.states import ACTIVE_STATES, TERMINAL_STATES, JobState
from scheduler_service.settings import GreenflowConfig

# How many of a job's newest telemetry samples its current throughput is averaged over.
RATE_WINDOW_SAMPLES = 5
# Jobs whose completion is projected for their deadline (not yet finished).
UNFINISHED_STATES = tuple(
    s.value for s in JobState if s not in TERMINAL_STATES and s is not JobState.PENDING
)
HISTORY = timedelta(hours=24)
# The overview lists at most this many deadline risks (and says how many there are).
RISKS_SHOWN = 50


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


def project_completion(job: Job, recent_rates: Sequence[float], now: datetime) -> Projection:
    """Linear projection of a job's completion from its recent throughput (samples/s reports)."""
    state = JobState(job.state)
    if state in TERMINAL_STATES:
        return Projection(
            "missed" if state is JobState.DEADLINE_MISSED else "finished",
            None,
            job.finished_at,
            None,
            f"job is {state.value}",
        )
    rates = [rate for rate in recent_rates if rate > 0]
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


def plan_info(plan: Plan, misses: dict[int, str]) -> PlanInfo:
    """A plan's summary, with the deadline misses of the jobs the caller may see."""
    return PlanInfo(
        created_at=plan.created_at,
        start_at=plan.start_at,
        slot_s=plan.slot_s,
        slots=plan.num_slots,
        policy=plan.policy,
        status=plan.status,
        energy_kwh=plan.energy_kwh,
        emissions_kg=plan.emissions_kg,
        forecast_degraded=plan.forecast_degraded,
        deadline_misses={str(job_id): reason for job_id, reason in sorted(misses.items())},
    )


def planned_gpus(
    plan: Plan, per_slot: Sequence[float], *, one_job: bool = False
) -> list[tuple[datetime, float]]:
    """GPUs a plan gives per slot (all jobs' summed, or one job's), ending with the horizon."""
    n_slots = len(per_slot)
    if one_job:
        # One job: stop after its last planned GPU rather than running to the horizon at zero.
        n_slots = next((i + 1 for i in range(len(per_slot) - 1, -1, -1) if per_slot[i] > 0), 0)
        n_slots = min(n_slots + 1, len(per_slot))
    points = [
        (plan.start_at + timedelta(seconds=i * plan.slot_s), float(per_slot[i]))
        for i in range(n_slots)
    ]
    if n_slots:
        # Repeat the last value at the horizon so the last slot's step has its full width.
        points.append(
            (plan.start_at + timedelta(seconds=n_slots * plan.slot_s), float(per_slot[n_slots - 1]))
        )
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
    # "time" (Unix seconds) or "step" (a job's optimizer steps).
    x_kind: Literal["time", "step"] = "time"

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
            "x_kind": self.x_kind,
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
    # All jobs at risk (the page lists at most RISKS_SHOWN of them)
    risks_total: int

    @property
    def gpus_free(self) -> int:
        """GPUs on ready nodes that hold no job."""
        return self.gpus_total - self.gpus_used


def _owner_filter(principal: Principal) -> str | None:
    return None if principal.is_operator else principal.name


def budget_view(repo: ConsoleRepository, config: GreenflowConfig, now: datetime) -> BudgetView:
    """The current period's budget, spend and burn-down chart."""
    period = period_containing(
        now, config.budget.period, config.budget.time_zone, period_clock(config)
    )
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


def deadline_risks(
    repo: ConsoleRepository, owner: str | None, plan: Plan | None, now: datetime
) -> tuple[list[JobRisk], int]:
    """Unfinished jobs that miss or may miss their deadline (at most RISKS_SHOWN), and how many.

    The database selects them: running jobs projected after their deadline from their recent
    throughput (the same linear projection as `project_completion`), and the others whose
    deadline has passed; with both, any the plan misses. So neither the statements nor the rows
    read grow with the number of jobs.
    """
    plan_id = plan.id if plan is not None else None
    active_states = sorted(s.value for s in ACTIVE_STATES)
    waiting_states = [s for s in UNFINISHED_STATES if s not in active_states]
    running, running_total = repo.running_at_risk(
        active_states,
        owner=owner,
        plan_id=plan_id,
        now=now,
        rate_window=RATE_WINDOW_SAMPLES,
        limit=RISKS_SHOWN,
    )
    waiting, waiting_total = repo.deadline_jobs(
        waiting_states, owner=owner, plan_id=plan_id, late_before=now, limit=RISKS_SHOWN
    )
    risks = [
        JobRisk(job, project_completion(job, [rate] if rate is not None else [], now), reason)
        for job, reason, rate in running
    ]
    risks.extend(
        JobRisk(job, project_completion(job, [], now), plan_reason) for job, plan_reason in waiting
    )
    risks.sort(key=lambda risk: risk.job.id)
    return risks[:RISKS_SHOWN], running_total + waiting_total


def overview(
    session: Session, principal: Principal, config: GreenflowConfig, now: datetime
) -> Overview:
    """The overview page for this caller."""
    repo = ConsoleRepository(session)
    owner = _owner_filter(principal)
    total, used = repo.gpu_counts()
    counts = repo.count_by_state()
    risks, risks_total = deadline_risks(repo, owner, repo.latest_plan(), now)
    return Overview(
        gpus_total=total,
        gpus_used=used,
        jobs_by_state={s.value: counts.get(s.value, 0) for s in JobState},
        intensity=intensity_view(repo, config, now),
        budget=budget_view(repo, config, now),
        events=repo.recent_events(kinds=None, owner=owner, limit=15, skip_submissions=True),
        risks=risks,
        risks_total=risks_total,
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
    teams: list[TeamRow] = field(default_factory=list)


@dataclass(frozen=True)
class TeamRow:
    """A team's budget in the current period."""

    name: str
    queues: list[str]
    enforcement: str
    limit_kg: float
    spent_kg: float

    @property
    def left_kg(self) -> float:
        """Budget left (never negative)."""
        return max(0.0, self.limit_kg - self.spent_kg)

    @property
    def used_pct(self) -> float:
        """Share of the limit spent, in percent."""
        return 100.0 * self.spent_kg / self.limit_kg if self.limit_kg > 0 else 0.0


def team_rows(
    session: Session, principal: Principal, config: GreenflowConfig, now: datetime
) -> list[TeamRow]:
    """Team budgets this period: all for operators, a user's own queues' teams for users."""
    visible = (
        None if principal.is_operator else LedgerRepository(session).queues_of_owner(principal.name)
    )
    return [
        TeamRow(
            name=team,
            queues=config.budget.teams[team].queues,
            enforcement=config.budget.teams[team].enforcement,
            limit_kg=status.limit_kg,
            spent_kg=status.spent_kg,
        )
        for team, status in team_statuses(session, config, now).items()
        if visible is None or visible & set(config.budget.teams[team].queues)
    ]


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
                planned_gpus(plan, plan.total_gpus),
            )
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
        plan=plan_info(plan, repo.plan_misses(plan.id, owner=_owner_filter(principal)))
        if plan is not None
        else None,
        budget=budget,
        periods=periods,
        bucket_s=bucket_s,
        teams=team_rows(session, principal, config, now),
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
    planned_row = repo.plan_job(plan.id, job.id) if plan is not None else None
    planned = (
        planned_gpus(plan, padded(planned_row.gpus, plan.num_slots), one_job=True)
        if plan is not None and planned_row is not None
        else []
    )
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
    plan_reason = planned_row.deadline_miss if planned_row is not None else None
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
        projection=project_completion(job, [s.samples_per_s for s in recent], now),
        plan=plan_info(plan, {job.id: plan_reason} if plan_reason is not None else {})
        if plan is not None
        else None,
        plan_reason=plan_reason,
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


# A job's output -------------------------------------------------------------------------------

LR_NAMES = ("lr", "learning_rate")
# Series colours of the scalars chart, in order (the console's chart palette).
SCALAR_COLORS = ("--chart-1", "--chart-2", "--chart-3", "--chart-4")


@dataclass(frozen=True)
class JobOutput:
    """What a job page's output panel shows: rank 0's newest output and the scalars chart."""

    job_id: int
    finished: bool
    node: str | None
    tail: str
    tail_cut: bool
    curve: Chart
    plotted: list[str]
    other_scalars: list[str]
    unavailable: str | None = None


def step_marks(events: Sequence[JobEvent]) -> list[dict[str, Any]]:
    """Where on a per-step chart the job started, resumed and was hot-switched."""
    marks: list[dict[str, Any]] = []
    for event in events:
        step = _detail(event.details, "step")
        if not isinstance(step, int):
            continue
        if event.kind == "hot_switch":
            switch = hot_switch_of(event)
            label = (
                f"{switch.from_gpus if switch.from_gpus is not None else '?'}→"
                f"{switch.to_gpus if switch.to_gpus is not None else '?'} GPUs"
            )
            marks.append({"x": step, "label": label, "kind": "hot_switch"})
        elif event.kind == "allocation":
            gpus = _detail(event.details, "gpus")
            verb = "resumed" if step > 0 else "started"
            marks.append({"x": step, "label": f"{verb} on {gpus} GPUs", "kind": "start"})
    return marks


def scalars_chart(
    steps: Sequence[int],
    series: dict[str, list[float | None]],
    marks: list[dict[str, Any]],
) -> tuple[Chart, list[str], list[str]]:
    """The per-step chart of a job's scalars: losses on the left axis, the learning rate on the
    right; returns it, the names plotted and the names left out (listed under the chart)."""
    losses = [name for name in series if "loss" in name.lower()]
    rates = [name for name in series if name.lower() in LR_NAMES]
    if not losses and not rates and series:
        losses = [sorted(series)[0]]  # nothing named like a loss: the first name, alone
    lines: list[ChartSeries] = []
    for i, name in enumerate([*losses, *rates][: len(SCALAR_COLORS)]):
        right = name in rates
        lines.append(
            ChartSeries(
                name,
                "" if not right else "lr",
                list(series[name]),
                "lr" if right else "value",
                SCALAR_COLORS[i],
                dash=right,
            )
        )
    scales: dict[str, dict[str, Any]] = {"value": {"label": " / ".join(losses) or "value"}}
    if rates:
        scales["lr"] = {"label": "learning rate", "side": "right", "min": 0}
    plotted = [line.label for line in lines]
    chart = Chart(
        x=[float(step) for step in steps],
        series=lines,
        scales=scales,
        marks=marks,
        x_kind="step",
    )
    return chart, plotted, [name for name in sorted(series) if name not in plotted]


def job_output(
    job_id: int,
    finished: bool,
    marks: list[dict[str, Any]],
    source: LogSource | None,
    *,
    tail_bytes: int,
    max_points: int,
) -> JobOutput:
    """Fetch rank 0's output tail and the job's scalar curve from its agent (no DB session is
    used: call it after the page's transaction ended, the agent may take seconds)."""
    node = source.node if source is not None else None
    try:
        chunk = fetch_chunk(
            source, job_id, rank=0, stream="output", offset=0, limit=tail_bytes, tail=tail_bytes
        )
        curve = fetch_curve(source, job_id, max_points=max_points)
    except LogsUnavailable as exc:
        empty, _, _ = scalars_chart([], {}, marks)
        return JobOutput(job_id, finished, node, "", False, empty, [], [], str(exc))
    chart, plotted, others = scalars_chart(curve.steps, curve.series, marks)
    return JobOutput(
        job_id=job_id,
        finished=finished,
        node=node,
        tail=chunk.text,
        tail_cut=chunk.offset > 0,
        curve=chart,
        plotted=plotted,
        other_scalars=others,
    )
