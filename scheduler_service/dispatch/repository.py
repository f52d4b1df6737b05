"""Queries on allocations (the commands sent to agents) and plans."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from scheduler_service.db.models import Allocation, Job, Plan


class AllocationRepository:
    """All SQL touching allocations and plans."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, allocation: Allocation) -> Allocation:
        """Stage a command and give it an id."""
        self.session.add(allocation)
        self.session.flush()
        return allocation

    def latest(self, job_id: int) -> Allocation | None:
        """The newest command of a job."""
        return self.session.scalar(
            select(Allocation)
            .where(Allocation.job_id == job_id)
            .order_by(Allocation.generation.desc())
            .limit(1)
        )

    def latest_acked(self, job_id: int) -> Allocation | None:
        """The newest command of a job that its agent acknowledged."""
        return self.session.scalar(
            select(Allocation)
            .where(Allocation.job_id == job_id, Allocation.status == "acked")
            .order_by(Allocation.generation.desc())
            .limit(1)
        )

    def newest_by_job(
        self, job_ids: Collection[int] | None = None, *, acked: bool = False
    ) -> dict[int, Allocation]:
        """The newest command (or newest acknowledged one) of each job, in one query."""
        return {a.job_id: a for a in self.session.scalars(self._newest(job_ids, acked=acked))}

    def newest_running_of_jobs_in(self, states: Collection[str]) -> list[Allocation]:
        """Newest commands that give GPUs to jobs in `states` (e.g. finished jobs still running)."""
        stmt = (
            self._newest(None, acked=False)
            .join(Job, Job.id == Allocation.job_id)
            .where(Job.state.in_(list(states)), Allocation.gpus > 0)
            .order_by(Allocation.job_id)
        )
        return list(self.session.scalars(stmt))

    @staticmethod
    def _newest(job_ids: Collection[int] | None, *, acked: bool) -> Select[Allocation]:
        top = select(Allocation.job_id, func.max(Allocation.generation).label("generation"))
        if acked:
            top = top.where(Allocation.status == "acked")
        if job_ids is not None:
            top = top.where(Allocation.job_id.in_(list(job_ids)))
        newest = top.group_by(Allocation.job_id).subquery()
        return select(Allocation).join(
            newest,
            (Allocation.job_id == newest.c.job_id) & (Allocation.generation == newest.c.generation),
        )

    def unacknowledged(self) -> list[Allocation]:
        """Commands still to deliver (pending or failed delivery), oldest first."""
        stmt = (
            select(Allocation)
            .where(Allocation.status.in_(("pending", "unreachable")))
            .order_by(Allocation.id)
        )
        return list(self.session.scalars(stmt))

    def get(self, allocation_id: int) -> Allocation | None:
        """A command by id."""
        return self.session.get(Allocation, allocation_id)

    def add_plan(self, plan: Plan) -> None:
        """Stage a plan."""
        self.session.add(plan)

    def latest_plan(self) -> Plan | None:
        """The current plan."""
        return self.session.scalar(select(Plan).order_by(Plan.id.desc()).limit(1))

    def prune_plans(self, keep: int) -> None:
        """Delete all but the newest `keep` plans."""
        ids = list(self.session.scalars(select(Plan.id).order_by(Plan.id.desc()).offset(keep)))
        for plan_id in ids:
            plan = self.session.get(Plan, plan_id)
            if plan is not None:
                self.session.delete(plan)
