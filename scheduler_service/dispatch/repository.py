"""Queries on allocations (the commands sent to agents) and plans."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Integer,
    Select,
    Table,
    Text,
    delete,
    func,
    insert,
    literal,
    select,
)
from sqlalchemy import cast as cast_as
from sqlalchemy.orm import Session, defer

from scheduler_service.db.bulk import on_postgresql, unnested
from scheduler_service.db.ids import ids_in
from scheduler_service.db.models import Allocation, Job, Plan, PlanJob
from scheduler_service.dispatch.plans import PLAN_BULK_COLUMNS, index_totals, plan_job_values


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

    def latest_with_node(self, job_id: int) -> Allocation | None:
        """The newest command of a job that went to a node (where its output is kept)."""
        return self.session.scalar(
            select(Allocation)
            .where(Allocation.job_id == job_id, Allocation.node_id.is_not(None))
            .order_by(Allocation.generation.desc())
            .limit(1)
        )

    def by_generation(self, job_id: int, *, since: int = 0) -> dict[int, Allocation]:
        """A job's commands from generation `since` on, by generation."""
        rows = self.session.scalars(
            select(Allocation).where(Allocation.job_id == job_id, Allocation.generation >= since)
        )
        return {a.generation: a for a in rows}

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

    def newest_and_newest_acked(
        self, job_ids: Collection[int]
    ) -> tuple[dict[int, Allocation], dict[int, Allocation]]:
        """The newest command and the newest acknowledged one of each job, in one query (the
        same object where the newest is acknowledged)."""
        if not job_ids:
            return {}, {}
        top = (
            select(
                Allocation.job_id,
                func.max(Allocation.generation).label("newest"),
                func.max(Allocation.generation).filter(Allocation.status == "acked").label("acked"),
            )
            .where(ids_in(Allocation.job_id, job_ids))
            .group_by(Allocation.job_id)
            .subquery()
        )
        stmt = select(Allocation, top.c.newest, top.c.acked).join(
            top,
            (Allocation.job_id == top.c.job_id)
            & ((Allocation.generation == top.c.newest) | (Allocation.generation == top.c.acked)),
        )
        newest: dict[int, Allocation] = {}
        acked: dict[int, Allocation] = {}
        for allocation, newest_generation, acked_generation in self.session.execute(stmt):
            if allocation.generation == newest_generation:
                newest[allocation.job_id] = allocation
            if allocation.generation == acked_generation:
                acked[allocation.job_id] = allocation
        return newest, acked

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
            top = top.where(ids_in(Allocation.job_id, job_ids))
        newest = top.group_by(Allocation.job_id).subquery()
        return select(Allocation).join(
            newest,
            (Allocation.job_id == newest.c.job_id) & (Allocation.generation == newest.c.generation),
        )

    def unacknowledged(self, job_id: int | None = None) -> list[Allocation]:
        """Commands still to deliver (pending or failed delivery), oldest first; `job_id`: only
        that job's."""
        stmt = (
            select(Allocation)
            .where(Allocation.status.in_(("pending", "unreachable")))
            .order_by(Allocation.id)
        )
        if job_id is not None:
            stmt = stmt.where(Allocation.job_id == job_id)
        return list(self.session.scalars(stmt))

    def get(self, allocation_id: int) -> Allocation | None:
        """A command by id."""
        return self.session.get(Allocation, allocation_id)

    def get_many(self, allocation_ids: Collection[int]) -> dict[int, Allocation]:
        """Commands by id, in one query."""
        if not allocation_ids:
            return {}
        stmt = select(Allocation).where(ids_in(Allocation.id, sorted(allocation_ids)))
        return {a.id: a for a in self.session.scalars(stmt)}

    def add_plan(
        self,
        plan: Plan,
        gpus_by_job: Mapping[str, Sequence[int]],
        deadline_misses: Mapping[str, str],
    ) -> None:
        """Store a plan with its per-slot totals, and its per-job rows (the only copy of its
        GPUs per job and slot) in one executemany."""
        self.session.add(index_totals(plan, gpus_by_job))
        self.session.flush()
        values = plan_job_values(gpus_by_job, deadline_misses)
        table = cast(Table, PlanJob.__table__)
        if values and on_postgresql(self.session):
            # One statement with an array per column (`db.bulk`): the executemany below sends
            # a statement per job.
            given = unnested(
                "given",
                [
                    ("job_id", BigInteger(), [row["job_id"] for row in values]),
                    ("gpus", Text(), [json.dumps(row["gpus"]) for row in values]),
                    ("deadline_miss", Text(), [row["deadline_miss"] for row in values]),
                ],
            )
            self.session.execute(
                insert(table).from_select(
                    ["plan_id", "job_id", "gpus", "deadline_miss"],
                    select(
                        literal(plan.id, Integer()),
                        given.c.job_id,
                        cast_as(given.c.gpus, JSON()),
                        given.c.deadline_miss,
                    ),
                )
            )
        elif values:
            # Plain rows, not one `PlanJob` object per job: at 5,000 jobs building and flushing
            # those was a second of every tick.
            rows = [{**row, "plan_id": plan.id} for row in values]
            self.session.execute(insert(table), rows)

    def latest_plan_header(self) -> Plan | None:
        """The current plan without its per-slot JSON (reading `slots` raises)."""
        stmt = (
            select(Plan)
            .options(*(defer(column, raiseload=True) for column in PLAN_BULK_COLUMNS))
            .order_by(Plan.id.desc())
            .limit(1)
        )
        return self.session.scalar(stmt)

    def plan_slots(self, plan_id: int) -> list[dict[str, Any]]:
        """A plan's per-slot capacity, intensity, energy and emissions (one small JSON column)."""
        return list(self.session.scalar(select(Plan.slots).where(Plan.id == plan_id)) or [])

    def plan_jobs(
        self, plan_id: int, *, job_ids: Collection[int] | None = None, owner: str | None = None
    ) -> list[PlanJob]:
        """A plan's per-job rows (of these jobs, of `owner`'s jobs when given), by job id."""
        stmt = select(PlanJob).where(PlanJob.plan_id == plan_id).order_by(PlanJob.job_id)
        if job_ids is not None:
            stmt = stmt.where(ids_in(PlanJob.job_id, job_ids))
        if owner is not None:
            stmt = stmt.join(Job, Job.id == PlanJob.job_id).where(Job.owner == owner)
        return list(self.session.scalars(stmt))

    def prune_plans(self, keep: int) -> None:
        """Delete all but the newest `keep` plans (their per-job rows go with them)."""
        newest = select(Plan.id).order_by(Plan.id.desc()).limit(keep).scalar_subquery()
        cutoff = select(func.min(Plan.id)).where(Plan.id.in_(newest)).scalar_subquery()
        self.session.execute(
            delete(Plan).where(Plan.id < cutoff).execution_options(synchronize_session=False)
        )
