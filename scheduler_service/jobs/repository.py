"""Queries on jobs and job_events."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from scheduler_service.db.models import Job, JobEvent


class JobRepository:
    """All SQL touching jobs and job_events."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, job: Job) -> Job:
        """Stage a new job and give it an id."""
        self.session.add(job)
        self.session.flush()
        return job

    def add_event(self, event: JobEvent) -> JobEvent:
        """Stage a job event."""
        self.session.add(event)
        return event

    def get(self, job_id: int, *, for_update: bool = False) -> Job | None:
        """The job with this id, optionally locked for update (PostgreSQL)."""
        stmt = select(Job).where(Job.id == job_id)
        if for_update:
            stmt = stmt.with_for_update()
        return self.session.scalar(stmt)

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

    def in_states(self, states: Sequence[str]) -> list[Job]:
        """Every job in one of `states`, oldest first."""
        return list(self.session.scalars(select(Job).where(Job.state.in_(states)).order_by(Job.id)))

    def count_by_state(self) -> dict[str, int]:
        """Number of jobs in each state."""
        rows = self.session.execute(select(Job.state, func.count()).group_by(Job.state))
        return {state: count for state, count in rows}

    def has_event(self, job_id: int, kind: str) -> bool:
        """Whether the job has an event of this kind."""
        stmt = select(JobEvent.id).where(JobEvent.job_id == job_id, JobEvent.kind == kind).limit(1)
        return self.session.scalar(stmt) is not None

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
