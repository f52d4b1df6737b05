"""Read queries of the console (every SQL statement the console runs lives here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    Select,
    Text,
    and_,
    case,
    cast,
    extract,
    func,
    literal,
    not_,
    or_,
    select,
    union,
)
from sqlalchemy.orm import Session, defer, selectinload

from scheduler_service.db.ids import ids_in
from scheduler_service.db.models import (
    Allocation,
    CarbonForecastRecord,
    CarbonIntensitySample,
    GpuSlot,
    Job,
    JobEvent,
    LedgerEntry,
    Node,
    Plan,
    PlanJob,
    TelemetrySample,
)
from scheduler_service.dispatch.plans import PLAN_BULK_COLUMNS

# Columns the job list may be sorted by (query value -> column).
SORTABLE_COLUMNS = {
    "id": Job.id,
    "name": Job.name,
    "owner": Job.owner,
    "queue": Job.queue,
    "state": Job.state,
    "priority": Job.priority,
    "gpus": Job.current_gpus,
    "deadline": Job.deadline_at,
    "created": Job.created_at,
}


@dataclass(frozen=True)
class EventRow:
    """A job event with the name and owner of its job."""

    event: JobEvent
    job_name: str
    job_owner: str


@dataclass(frozen=True)
class GpuUseRow:
    """The most GPUs one job reported in one time bucket (bucket n starts n x bucket_s after 1970)."""

    bucket: int
    job_id: int
    gpus: int


@dataclass(frozen=True)
class TelemetryBucket:
    """A job's telemetry over one time bucket: first and last report, peak GPUs, mean rate and power."""

    first_at: datetime
    last_at: datetime
    interval_s: float
    gpus: int
    samples_per_s: float
    power_w: float


@dataclass(frozen=True)
class LayoutChange:
    """A telemetry report whose GPU count or layout differs from the report before it."""

    at: datetime
    interval_s: float
    gpus: int
    layout: str | None


@dataclass(frozen=True)
class PeriodTotal:
    """Emissions and energy charged in one budget period."""

    period_start: datetime
    period_end: datetime
    emissions_kg: float
    energy_kwh: float


class ConsoleRepository:
    """All SQL the console runs (reads only; actions go through the jobs service)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    # Jobs -----------------------------------------------------------------------------------

    def job(self, job_id: int) -> Job | None:
        """One job by id."""
        return self.session.get(Job, job_id)

    def jobs_page(
        self,
        *,
        owner: str | None,
        states: Sequence[str],
        queue: str | None,
        search: str | None,
        sort: str,
        descending: bool,
        limit: int,
        offset: int,
    ) -> tuple[list[Job], int]:
        """A filtered, sorted page of jobs and the number that match."""
        stmt: Select[tuple[Job]] = select(Job)
        if owner is not None:
            stmt = stmt.where(Job.owner == owner)
        if states:
            stmt = stmt.where(Job.state.in_(states))
        if queue is not None:
            stmt = stmt.where(Job.queue == queue)
        if search:
            stmt = stmt.where(Job.name.contains(search, autoescape=True))
        total = self.session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
        column = SORTABLE_COLUMNS[sort]
        order = column.desc() if descending else column.asc()
        # Nulls (e.g. no deadline) last either way, then a stable tie-break on id.
        stmt = stmt.order_by(column.is_(None), order, Job.id.desc()).limit(limit).offset(offset)
        return list(self.session.scalars(stmt)), total

    def owners(self) -> list[str]:
        """Every owner with at least one job, sorted."""
        return list(self.session.scalars(select(Job.owner).distinct().order_by(Job.owner)))

    def queues(self, *, owner: str | None) -> list[str]:
        """Every queue that holds a job (of `owner` when given), sorted."""
        stmt = select(Job.queue).distinct().order_by(Job.queue)
        if owner is not None:
            stmt = stmt.where(Job.owner == owner)
        return list(self.session.scalars(stmt))

    def count_by_state(self, *, owner: str | None = None) -> dict[str, int]:
        """Number of jobs in each state (of `owner` when given)."""
        stmt = select(Job.state, func.count()).group_by(Job.state)
        if owner is not None:
            stmt = stmt.where(Job.owner == owner)
        return {state: count for state, count in self.session.execute(stmt)}

    def deadline_jobs(
        self,
        states: Sequence[str],
        *,
        owner: str | None,
        plan_id: int | None,
        late_before: datetime | None = None,
        limit: int | None = None,
    ) -> tuple[list[tuple[Job, str | None]], int]:
        """Jobs with a deadline in these states, each with the plan's reason for missing it, by id.

        With `late_before`, only the jobs whose deadline is before it or that the plan misses
        (two indexed selections, not a scan of every job). Returns at most `limit` of them, and
        how many match.
        """
        where: list[ColumnElement[bool]] = [
            Job.state.in_(list(states)),
            Job.deadline_at.is_not(None),
        ]
        if owner is not None:
            where.append(Job.owner == owner)
        in_plan = and_(PlanJob.plan_id == plan_id, PlanJob.job_id == Job.id)
        if plan_id is not None:
            stmt = select(Job, PlanJob.deadline_miss).outerjoin(PlanJob, in_plan)
        else:
            stmt = select(Job, literal(None, Text))
        stmt = stmt.where(*where).order_by(Job.id)
        total: int | None = None
        if late_before is not None:
            late: Any = select(Job.id).where(*where, Job.deadline_at < late_before)
            if plan_id is not None:
                missed = (
                    select(Job.id)
                    .join(PlanJob, in_plan)
                    .where(*where, PlanJob.deadline_miss.is_not(None))
                )
                late = union(late, missed)
            chosen = late.subquery()
            total = self.session.scalar(select(func.count()).select_from(chosen)) or 0
            stmt = stmt.where(Job.id.in_(select(chosen.c.id)))
        if limit is not None:
            stmt = stmt.limit(limit)
        rows = [(job, reason) for job, reason in self.session.execute(stmt)]
        return rows, total if total is not None else len(rows)

    def running_at_risk(
        self,
        states: Sequence[str],
        *,
        owner: str | None,
        plan_id: int | None,
        now: datetime,
        rate_window: int,
        limit: int,
    ) -> tuple[list[tuple[Job, str | None, float | None]], int]:
        """Running jobs with a deadline that the plan misses or that, at the mean of their newest
        `rate_window` positive samples/s, finish after it: at most `limit` by id, with the plan's
        reason and that rate, and how many there are (the projection runs in the database)."""
        where: list[ColumnElement[bool]] = [
            Job.state.in_(list(states)),
            Job.deadline_at.is_not(None),
        ]
        if owner is not None:
            where.append(Job.owner == owner)
        newest_first = func.row_number().over(
            partition_by=TelemetrySample.job_id,
            order_by=(TelemetrySample.at.desc(), TelemetrySample.id.desc()),
        )
        ranked = (
            select(TelemetrySample.job_id, TelemetrySample.samples_per_s, newest_first.label("n"))
            .join(Job, Job.id == TelemetrySample.job_id)
            .where(*where)
            .subquery()
        )
        positive = case((ranked.c.samples_per_s > 0, ranked.c.samples_per_s))
        rates = (
            select(ranked.c.job_id, func.avg(positive).label("rate"))
            .where(ranked.c.n <= rate_window)
            .group_by(ranked.c.job_id)
            .subquery()
        )
        total = func.coalesce(Job.total_samples, Job.total_steps * Job.global_batch_size)
        remaining = case((total > Job.samples_done, total - Job.samples_done), else_=0)
        left_s = self._epoch_s(Job.deadline_at) - now.timestamp()
        # completion = now + remaining / rate lands after the deadline
        late = and_(rates.c.rate > 0, total.is_not(None), remaining > rates.c.rate * left_s)
        in_plan = and_(PlanJob.plan_id == plan_id, PlanJob.job_id == Job.id)
        miss: Any = PlanJob.deadline_miss if plan_id is not None else literal(None, Text)
        stmt: Any = select(Job, miss, rates.c.rate).outerjoin(rates, rates.c.job_id == Job.id)
        count: Any = select(func.count(Job.id)).outerjoin(rates, rates.c.job_id == Job.id)
        if plan_id is not None:
            stmt = stmt.outerjoin(PlanJob, in_plan)
            count = count.outerjoin(PlanJob, in_plan)
        risky = or_(late, miss.is_not(None)) if plan_id is not None else late
        total_count = self.session.scalar(count.where(*where, risky)) or 0
        stmt = stmt.where(*where, risky).order_by(Job.id).limit(limit)
        rows = [
            (job, reason, float(rate) if rate is not None else None)
            for job, reason, rate in self.session.execute(stmt)
        ]
        return rows, total_count

    def _epoch_s(self, column: Any) -> Any:
        """Seconds since 1970 of a timestamp column."""
        if self.session.get_bind().dialect.name == "sqlite":
            return cast(func.strftime("%s", column), Integer)  # naive UTC text
        return extract("epoch", column)

    def jobs_by_ids(self, job_ids: Sequence[int]) -> dict[int, Job]:
        """The jobs with these ids, by id."""
        if not job_ids:
            return {}
        rows = self.session.scalars(select(Job).where(ids_in(Job.id, job_ids)))
        return {job.id: job for job in rows}

    # Events ---------------------------------------------------------------------------------

    def job_events(self, job_id: int, *, limit: int = 1000) -> list[JobEvent]:
        """A job's events, oldest first."""
        stmt = (
            select(JobEvent)
            .where(JobEvent.job_id == job_id)
            .order_by(JobEvent.at, JobEvent.id)
            .limit(limit)
        )
        return list(self.session.scalars(stmt))

    def recent_events(
        self,
        *,
        kinds: Sequence[str] | None,
        owner: str | None,
        limit: int,
        skip_submissions: bool = False,
    ) -> list[EventRow]:
        """The newest events (of these kinds, of `owner`'s jobs when given), newest first."""
        stmt = (
            select(JobEvent, Job.name, Job.owner)
            .join(Job, Job.id == JobEvent.job_id)
            .order_by(JobEvent.at.desc(), JobEvent.id.desc())
            .limit(limit)
        )
        if kinds:
            stmt = stmt.where(JobEvent.kind.in_(list(kinds)))
        if skip_submissions:
            # "submitted" and "accepted" say little on a busy cluster; every other event stays.
            stmt = stmt.where(
                not_(
                    and_(
                        JobEvent.kind == "state",
                        or_(
                            JobEvent.from_state.is_(None),
                            and_(JobEvent.from_state == "PENDING", JobEvent.to_state == "QUEUED"),
                        ),
                    )
                )
            )
        if owner is not None:
            stmt = stmt.where(Job.owner == owner)
        return [
            EventRow(event=event, job_name=name, job_owner=job_owner)
            for event, name, job_owner in self.session.execute(stmt)
        ]

    # Telemetry and allocations --------------------------------------------------------------

    def _bucket(self, column: Any, bucket_s: int) -> Any:
        """The bucket index (seconds since 1970 floor-divided by bucket_s) of a timestamp column."""
        if self.session.get_bind().dialect.name == "sqlite":
            # SQLite stores naive UTC text; integer division of integers floors.
            return cast(func.strftime("%s", column), Integer) // bucket_s
        return func.floor(extract("epoch", column) / bucket_s)

    def telemetry_span(self, job_id: int) -> tuple[datetime | None, datetime | None]:
        """The first and last report time of a job's telemetry."""
        row = self.session.execute(
            select(func.min(TelemetrySample.at), func.max(TelemetrySample.at)).where(
                TelemetrySample.job_id == job_id
            )
        ).one()
        return row[0], row[1]

    def telemetry_buckets(self, job_id: int, *, bucket_s: int) -> list[TelemetryBucket]:
        """A job's telemetry aggregated per time bucket, in time order (charts stay small)."""
        bucket = self._bucket(TelemetrySample.at, bucket_s).label("bucket")
        stmt = (
            select(
                func.min(TelemetrySample.at),
                func.max(TelemetrySample.at),
                func.max(TelemetrySample.interval_s),
                func.max(TelemetrySample.gpus),
                func.avg(TelemetrySample.samples_per_s),
                func.avg(TelemetrySample.power_w),
            )
            .where(TelemetrySample.job_id == job_id)
            .group_by(bucket)
            .order_by(bucket)
        )
        return [
            TelemetryBucket(
                first_at=first,
                last_at=last,
                interval_s=float(interval),
                gpus=int(gpus),
                samples_per_s=float(rate),
                power_w=float(power),
            )
            for first, last, interval, gpus, rate, power in self.session.execute(stmt)
        ]

    def layout_changes(self, job_id: int) -> list[LayoutChange]:
        """The reports at which a job's GPU count or layout changed (the first report included)."""
        order = (TelemetrySample.at, TelemetrySample.id)
        inner = (
            select(
                TelemetrySample.at,
                TelemetrySample.interval_s,
                TelemetrySample.gpus,
                TelemetrySample.layout,
                func.lag(TelemetrySample.gpus).over(order_by=order).label("prev_gpus"),
                func.lag(TelemetrySample.layout).over(order_by=order).label("prev_layout"),
                func.row_number().over(order_by=order).label("n"),
            )
            .where(TelemetrySample.job_id == job_id)
            .subquery()
        )
        stmt = (
            select(inner.c.at, inner.c.interval_s, inner.c.gpus, inner.c.layout)
            .where(
                or_(
                    inner.c.n == 1,
                    inner.c.prev_gpus != inner.c.gpus,
                    inner.c.prev_layout.is_distinct_from(inner.c.layout),
                )
            )
            .order_by(inner.c.at)
        )
        return [
            LayoutChange(at=at, interval_s=float(interval), gpus=gpus, layout=layout)
            for at, interval, gpus, layout in self.session.execute(stmt)
        ]

    def recent_telemetry(self, job_id: int, *, limit: int) -> list[TelemetrySample]:
        """A job's newest telemetry samples, oldest of them first."""
        stmt = (
            select(TelemetrySample)
            .where(TelemetrySample.job_id == job_id)
            .order_by(TelemetrySample.at.desc())
            .limit(limit)
        )
        return list(reversed(list(self.session.scalars(stmt))))

    def job_energy_kwh(self, job_id: int) -> float:
        """Energy a job's telemetry reported, summed over its intervals."""
        stmt = select(func.coalesce(func.sum(TelemetrySample.energy_kwh), 0.0)).where(
            TelemetrySample.job_id == job_id
        )
        return float(self.session.scalar(stmt) or 0.0)

    def job_emissions_kg(self, job_id: int) -> float:
        """Emissions the ledger charged to a job, over all periods."""
        stmt = select(func.coalesce(func.sum(LedgerEntry.emissions_kg), 0.0)).where(
            LedgerEntry.job_id == job_id
        )
        return float(self.session.scalar(stmt) or 0.0)

    def gpu_use(self, *, since: datetime, until: datetime, bucket_s: int) -> list[GpuUseRow]:
        """Per time bucket and job, the most GPUs the job reported between two times."""
        bucket = self._bucket(TelemetrySample.at, bucket_s).label("bucket")
        stmt = (
            select(bucket, TelemetrySample.job_id, func.max(TelemetrySample.gpus))
            .where(TelemetrySample.at >= since, TelemetrySample.at < until)
            .group_by(bucket, TelemetrySample.job_id)
            .order_by(bucket)
        )
        return [
            GpuUseRow(bucket=int(b), job_id=job_id, gpus=int(gpus))
            for b, job_id, gpus in self.session.execute(stmt)
        ]

    def allocations(self, job_id: int) -> list[Allocation]:
        """A job's allocation commands, by generation."""
        stmt = select(Allocation).where(Allocation.job_id == job_id).order_by(Allocation.generation)
        return list(self.session.scalars(stmt))

    # Nodes ----------------------------------------------------------------------------------

    def nodes_with_slots(self) -> list[Node]:
        """Every node with its slots loaded, by name."""
        stmt = select(Node).options(selectinload(Node.slots)).order_by(Node.name)
        return list(self.session.scalars(stmt))

    def gpu_counts(self) -> tuple[int, int]:
        """(GPUs on ready nodes, of those the ones holding a job)."""
        base = select(func.count(GpuSlot.id)).join(Node).where(Node.state == "ready")
        total = self.session.scalar(base) or 0
        used = self.session.scalar(base.where(GpuSlot.job_id.is_not(None))) or 0
        return total, used

    # Carbon and budget ----------------------------------------------------------------------

    def intensity_samples(
        self, *, region: str, since: datetime, until: datetime
    ) -> list[CarbonIntensitySample]:
        """Intensity samples of a region between two times, by time then fetch time."""
        stmt = (
            select(CarbonIntensitySample)
            .where(
                CarbonIntensitySample.region == region,
                CarbonIntensitySample.at >= since,
                CarbonIntensitySample.at <= until,
            )
            .order_by(CarbonIntensitySample.at, CarbonIntensitySample.fetched_at)
        )
        return list(self.session.scalars(stmt))

    def latest_intensity(self, *, region: str) -> CarbonIntensitySample | None:
        """The newest intensity sample of a region."""
        stmt = (
            select(CarbonIntensitySample)
            .where(CarbonIntensitySample.region == region)
            .order_by(CarbonIntensitySample.at.desc(), CarbonIntensitySample.fetched_at.desc())
            .limit(1)
        )
        return self.session.scalar(stmt)

    def latest_forecast(self, *, region: str) -> CarbonForecastRecord | None:
        """The newest forecast fetched for a region."""
        stmt = (
            select(CarbonForecastRecord)
            .where(CarbonForecastRecord.region == region)
            .order_by(CarbonForecastRecord.fetched_at.desc(), CarbonForecastRecord.id.desc())
            .limit(1)
        )
        return self.session.scalar(stmt)

    def ledger_in_period(self, *, period_start: datetime) -> list[LedgerEntry]:
        """Ledger entries charged to the period that starts at `period_start`, by interval end."""
        stmt = (
            select(LedgerEntry)
            .where(LedgerEntry.period_start == period_start)
            .order_by(LedgerEntry.interval_end, LedgerEntry.id)
        )
        return list(self.session.scalars(stmt))

    def period_totals(self, *, limit: int) -> list[PeriodTotal]:
        """Emissions and energy per budget period, newest period first."""
        stmt = (
            select(
                LedgerEntry.period_start,
                func.max(LedgerEntry.period_end),
                func.sum(LedgerEntry.emissions_kg),
                func.sum(LedgerEntry.energy_kwh),
            )
            .group_by(LedgerEntry.period_start)
            .order_by(LedgerEntry.period_start.desc())
            .limit(limit)
        )
        return [
            PeriodTotal(
                period_start=start,
                period_end=end,
                emissions_kg=float(emissions or 0.0),
                energy_kwh=float(energy or 0.0),
            )
            for start, end, emissions, energy in self.session.execute(stmt)
        ]

    # Plan -----------------------------------------------------------------------------------

    def latest_plan(self) -> Plan | None:
        """The newest plan (the current plan) without its bulk JSON: pages read `plan_jobs`."""
        stmt = (
            select(Plan)
            .options(*(defer(column, raiseload=True) for column in PLAN_BULK_COLUMNS))
            .order_by(Plan.id.desc())
            .limit(1)
        )
        return self.session.scalar(stmt)

    def plan_misses(self, plan_id: int, *, owner: str | None) -> dict[int, str]:
        """Why the plan misses deadlines, by job (of `owner`'s jobs when given)."""
        stmt = select(PlanJob.job_id, PlanJob.deadline_miss).where(
            PlanJob.plan_id == plan_id, PlanJob.deadline_miss.is_not(None)
        )
        if owner is not None:
            stmt = stmt.join(Job, Job.id == PlanJob.job_id).where(Job.owner == owner)
        return {job_id: reason or "" for job_id, reason in self.session.execute(stmt)}

    def plan_job(self, plan_id: int, job_id: int) -> PlanJob | None:
        """One job's part of a plan."""
        return self.session.get(PlanJob, (plan_id, job_id))
