"""Queries on allocations (the commands sent to agents) and plans."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from scheduler_service.db.models import Allocation, Plan


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

    def next_generation(self, job_id: int) -> int:
        """One more than the highest generation issued for the job."""
        top = self.session.scalar(
            select(func.max(Allocation.generation)).where(Allocation.job_id == job_id)
        )
        return int(top or 0) + 1

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
