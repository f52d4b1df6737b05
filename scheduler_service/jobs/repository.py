"""Queries on jobs and job_events."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    CursorResult,
    Integer,
    Row,
    Table,
    Text,
    bindparam,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from scheduler_service.db.base import UTCDateTime
from scheduler_service.db.bulk import on_postgresql, unnested
from scheduler_service.db.ids import ids_in
from scheduler_service.db.models import Job, JobEvent
from scheduler_service.jobs.states import JobState


@dataclass(frozen=True)
class PlanRow:
    """The columns a tick's snapshot plans a job from: a plain row, not an ORM object (at
    5,000 queued jobs loading each as a `Job` was most of the snapshot's reads)."""

    id: int
    version: int
    state: str
    held: bool
    queue: str
    priority: int
    deadline_at: datetime | None
    begin_after: datetime | None
    min_gpus: int
    max_gpus: int
    best_effort: bool
    total_samples: int | None
    total_steps: int | None
    global_batch_size: int
    samples_done: int
    workload: str
    current_gpus: int
    current_layout: str | None


PLAN_COLUMNS = tuple(getattr(Job, f.name) for f in fields(PlanRow))


class JobRepository:
    """All SQL touching jobs and job_events."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, job: Job) -> Job:
        """Stage a new job and give it an id."""
        self.session.add(job)
        self.session.flush()
        return job

    def insert_submitted(
        self, job: Mapping[str, Any], events: Sequence[Mapping[str, Any]]
    ) -> Row[Any]:
        """Insert a new job and its first events (two statements, no unit-of-work flush: on the
        submission path the flush cost more CPU than the rest of the request); the stored row,
        every column, is returned (it reads like a `Job`, but is not tracked by the session)."""
        jobs, job_events = cast(Table, Job.__table__), cast(Table, JobEvent.__table__)
        row = self.session.execute(insert(jobs).returning(*jobs.c), dict(job)).one()
        self.session.execute(insert(job_events), [{**event, "job_id": row.id} for event in events])
        return row

    def add_event(self, event: JobEvent) -> JobEvent:
        """Stage a job event."""
        self.session.add(event)
        return event

    def get(self, job_id: int, *, for_update: bool = False) -> Job | None:
        """The job with this id, optionally locked for update (PostgreSQL)."""
        stmt = select(Job).where(Job.id == job_id)
        if for_update:
            # Re-read the row under the lock: an earlier read of it in this session may be stale.
            stmt = stmt.with_for_update().execution_options(populate_existing=True)
        return self.session.scalar(stmt)

    def get_many(self, job_ids: Sequence[int], *, for_update: bool = False) -> dict[int, Job]:
        """The jobs with these ids, in one query; optionally locked for update (PostgreSQL), in
        id order (the order the ORM's flushes lock rows in, so two such writers cannot deadlock)."""
        if not job_ids:
            return {}
        stmt = select(Job).where(ids_in(Job.id, job_ids))
        if for_update:
            stmt = stmt.order_by(Job.id).with_for_update().execution_options(populate_existing=True)
        return {job.id: job for job in self.session.scalars(stmt)}

    def by_submission_id(self, owner: str, submission_id: str) -> Job | None:
        """The job an owner submitted under this client-chosen id."""
        return self.session.scalar(
            select(Job).where(Job.owner == owner, Job.submission_id == submission_id)
        )

    def page(
        self,
        *,
        owner: str | None,
        states: Sequence[str],
        queue: str | None,
        limit: int,
        offset: int,
    ) -> tuple[list[Job], int]:
        """A page of jobs (newest first) matching the filters, and the total count."""
        stmt = select(Job)
        if owner is not None:
            stmt = stmt.where(Job.owner == owner)
        if states:
            stmt = stmt.where(Job.state.in_(states))
        if queue is not None:
            stmt = stmt.where(Job.queue == queue)
        total = self.session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
        rows = self.session.scalars(stmt.order_by(Job.id.desc()).limit(limit).offset(offset))
        return list(rows), total

    def in_states(self, states: Sequence[str], *, deadline_by: datetime | None = None) -> list[Job]:
        """Every job in one of `states` (with a deadline at or before `deadline_by` when given),
        oldest first."""
        stmt = select(Job).where(Job.state.in_(states))
        if deadline_by is not None:
            stmt = stmt.where(Job.deadline_at <= deadline_by)
        return list(self.session.scalars(stmt.order_by(Job.id)))

    def plan_rows_in_states(self, states: Sequence[str]) -> list[PlanRow]:
        """Every job in one of `states` as the columns planning reads, oldest first (one query,
        no ORM objects)."""
        stmt = select(*PLAN_COLUMNS).where(Job.state.in_(states)).order_by(Job.id)
        return [PlanRow(*row) for row in self.session.execute(stmt)]

    def plan_rows_of(self, job_ids: Collection[int]) -> dict[int, PlanRow]:
        """These jobs as the columns planning reads (one query, no ORM objects, no lock)."""
        if not job_ids:
            return {}
        stmt = select(*PLAN_COLUMNS).where(ids_in(Job.id, sorted(job_ids)))
        return {row.id: row for row in (PlanRow(*values) for values in self.session.execute(stmt))}

    def defer_queued(
        self, reasons: Mapping[int, str], versions: Mapping[int, int], at: datetime
    ) -> None:
        """Move these QUEUED jobs to DEFERRED with their reasons, and record each move's event:
        one UPDATE and one INSERT for all of them, no ORM object (on PostgreSQL each binds one
        array per column, `db.bulk`; elsewhere an executemany). A job no longer QUEUED at the
        version read (`versions`) raises StaleDataError: it changed meanwhile, and the tick
        plans again."""
        if not reasons:
            return
        ids = sorted(reasons)  # id order, as the ORM's flushes lock rows
        if on_postgresql(self.session):
            self._defer_queued_arrays(ids, reasons, versions, at)
            return
        jobs, job_events = cast(Table, Job.__table__), cast(Table, JobEvent.__table__)
        result = self.session.execute(
            update(jobs)
            .where(
                jobs.c.id == bindparam("b_id"),
                jobs.c.version == bindparam("b_version"),
                jobs.c.state == JobState.QUEUED.value,
            )
            .values(
                state=JobState.DEFERRED.value,
                state_reason=bindparam("b_reason"),
                version=jobs.c.version + 1,
                updated_at=at,
            ),
            [{"b_id": j, "b_version": versions[j], "b_reason": reasons[j]} for j in ids],
        )
        if cast(CursorResult[Any], result).rowcount != len(ids):
            raise StaleDataError(
                f"a queued job changed while the tick planned ({len(ids)} deferred)"
            )
        self.session.execute(
            insert(job_events),
            [
                {
                    "job_id": j,
                    "at": at,
                    "kind": "state",
                    "from_state": JobState.QUEUED.value,
                    "to_state": JobState.DEFERRED.value,
                    "reason": reasons[j],
                    "actor": "system",
                    "details": None,
                }
                for j in ids
            ],
        )

    def _defer_queued_arrays(
        self,
        ids: Sequence[int],
        reasons: Mapping[int, str],
        versions: Mapping[int, int],
        at: datetime,
    ) -> None:
        """`defer_queued` in three statements whatever the count (PostgreSQL)."""
        jobs, job_events = cast(Table, Job.__table__), cast(Table, JobEvent.__table__)
        # Locked first, in id order: an UPDATE joined to the array locks rows in its plan's
        # order, and telemetry locks jobs in id order (two orders could deadlock).
        self.session.execute(
            select(jobs.c.id).where(ids_in(jobs.c.id, ids)).order_by(jobs.c.id).with_for_update()
        ).all()
        given = unnested(
            "given",
            [
                ("id", BigInteger(), ids),
                ("version", Integer(), [versions[j] for j in ids]),
                ("reason", Text(), [reasons[j] for j in ids]),
            ],
        )
        result = self.session.execute(
            update(jobs)
            .where(
                jobs.c.id == given.c.id,
                jobs.c.version == given.c.version,
                jobs.c.state == JobState.QUEUED.value,
            )
            .values(
                state=JobState.DEFERRED.value,
                state_reason=given.c.reason,
                version=jobs.c.version + 1,
                updated_at=at,
            )
        )
        if cast(CursorResult[Any], result).rowcount != len(ids):
            raise StaleDataError(
                f"a queued job changed while the tick planned ({len(ids)} deferred)"
            )
        self.session.execute(
            insert(job_events).from_select(
                ["job_id", "at", "kind", "from_state", "to_state", "reason", "actor"],
                select(
                    given.c.id,
                    literal(at, UTCDateTime()),
                    literal("state"),
                    literal(JobState.QUEUED.value),
                    literal(JobState.DEFERRED.value),
                    given.c.reason,
                    literal("system"),
                ),
            )
        )

    def state_reasons(self, job_ids: Sequence[int]) -> dict[int, str]:
        """The state reason of each of these jobs (one query, no ORM objects)."""
        if not job_ids:
            return {}
        rows = self.session.execute(select(Job.id, Job.state_reason).where(ids_in(Job.id, job_ids)))
        return {job_id: reason for job_id, reason in rows}

    def with_event(self, job_ids: Sequence[int], kind: str) -> set[int]:
        """Which of these jobs have an event of this kind (one query)."""
        if not job_ids:
            return set()
        stmt = select(JobEvent.job_id).where(
            ids_in(JobEvent.job_id, job_ids), JobEvent.kind == kind
        )
        return set(self.session.scalars(stmt.distinct()))

    def count_by_state(self) -> dict[str, int]:
        """Number of jobs in each state."""
        rows = self.session.execute(select(Job.state, func.count()).group_by(Job.state))
        return {state: count for state, count in rows}

    def latest_events(self, job_ids: Sequence[int], kinds: Sequence[str]) -> dict[int, JobEvent]:
        """Per job, its newest event of these kinds (jobs without one are left out); one query
        per 500 jobs."""
        out: dict[int, JobEvent] = {}
        ids = list(job_ids)
        for begin in range(0, len(ids), 500):
            newest = (
                select(func.max(JobEvent.id))
                .where(JobEvent.job_id.in_(ids[begin : begin + 500]), JobEvent.kind.in_(kinds))
                .group_by(JobEvent.job_id)
            )
            for event in self.session.scalars(select(JobEvent).where(JobEvent.id.in_(newest))):
                out[event.job_id] = event
        return out

    def events(self, job_id: int, *, limit: int, offset: int) -> list[JobEvent]:
        """A job's events in the order they happened."""
        stmt = (
            select(JobEvent)
            .where(JobEvent.job_id == job_id)
            .order_by(JobEvent.id)
            .limit(limit)
            .offset(offset)
        )
        return list(self.session.scalars(stmt))
