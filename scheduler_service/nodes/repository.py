"""Queries on nodes and gpu_slots."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import cast

from sqlalchemy import Table, bindparam, func, select, update
from sqlalchemy.orm import Session, selectinload

from scheduler_service.db.ids import ids_in
from scheduler_service.db.models import GpuSlot, Node


class NodeRepository:
    """All SQL touching nodes and gpu_slots."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def gpu_counts(self) -> tuple[int, int]:
        """(GPUs on ready nodes, of those the ones holding a job)."""
        base = select(func.count(GpuSlot.id)).join(Node).where(Node.state == "ready")
        total = self.session.scalar(base) or 0
        used = self.session.scalar(base.where(GpuSlot.job_id.is_not(None))) or 0
        return total, used

    def nodes_with_slots(self, *, ready_only: bool = False) -> list[Node]:
        """Every node (or every ready node) with its slots loaded, by name."""
        stmt = select(Node).options(selectinload(Node.slots)).order_by(Node.name)
        if ready_only:
            stmt = stmt.where(Node.state == "ready")
        return list(self.session.scalars(stmt))

    def by_name(self, name: str) -> Node | None:
        """The node with this name."""
        return self.session.scalar(
            select(Node).options(selectinload(Node.slots)).where(Node.name == name)
        )

    def get(self, node_id: int) -> Node | None:
        """The node with this id."""
        return self.session.get(Node, node_id)

    def get_many(self, node_ids: list[int]) -> dict[int, Node]:
        """The nodes with these ids, in one query."""
        if not node_ids:
            return {}
        return {n.id: n for n in self.session.scalars(select(Node).where(Node.id.in_(node_ids)))}

    def add(self, node: Node) -> Node:
        """Stage a new node and give it an id."""
        self.session.add(node)
        self.session.flush()
        return node

    def add_slot(self, slot: GpuSlot) -> GpuSlot:
        """Stage a new GPU slot."""
        self.session.add(slot)
        return slot

    def delete_slot(self, slot: GpuSlot) -> None:
        """Remove a slot the node no longer offers."""
        self.session.delete(slot)

    def stale_ready_nodes(self, heartbeat_before: datetime) -> list[Node]:
        """Ready nodes whose last heartbeat is older than `heartbeat_before`."""
        stmt = select(Node).where(
            Node.state == "ready",
            (Node.last_heartbeat_at < heartbeat_before) | Node.last_heartbeat_at.is_(None),
        )
        return list(self.session.scalars(stmt))

    def slots_of_jobs(self, job_ids: list[int]) -> dict[int, list[GpuSlot]]:
        """The slots each of these jobs holds, by node and index, in one query."""
        stmt = (
            select(GpuSlot)
            .where(ids_in(GpuSlot.job_id, job_ids))
            .order_by(GpuSlot.node_id, GpuSlot.index)
        )
        out: dict[int, list[GpuSlot]] = {}
        for slot in self.session.scalars(stmt):
            assert slot.job_id is not None
            out.setdefault(slot.job_id, []).append(slot)
        return out

    def release_job(self, job_id: int) -> None:
        """Free every slot a job holds."""
        self.session.execute(update(GpuSlot).where(GpuSlot.job_id == job_id).values(job_id=None))

    def release_job_elsewhere(self, job_id: int, node_id: int) -> int:
        """Free the slots a job holds on nodes other than `node_id`; how many were freed."""
        result = self.session.execute(
            update(GpuSlot)
            .where(GpuSlot.job_id == job_id, GpuSlot.node_id != node_id)
            .values(job_id=None)
        )
        return int(getattr(result, "rowcount", 0) or 0)

    def report_lost(self, names: Sequence[str], at: datetime) -> None:
        """Note that a job's runner reported the workers on these nodes lost at `at`."""
        if names:
            self.session.execute(
                update(Node).where(Node.name.in_(list(names))).values(lost_reported_at=at)
            )

    def release_node(self, node_id: int) -> list[int]:
        """Free every slot of a node; return the ids of the jobs that held them."""
        jobs = self.session.scalars(
            select(GpuSlot.job_id)
            .where(GpuSlot.node_id == node_id, GpuSlot.job_id.is_not(None))
            .distinct()
        )
        job_ids = [j for j in jobs if j is not None]
        self.session.execute(update(GpuSlot).where(GpuSlot.node_id == node_id).values(job_id=None))
        return job_ids

    def assign(self, node_id: int, indices: list[int], job_id: int) -> None:
        """Give these slots of a node to a job (after releasing what it held elsewhere)."""
        self.release_job(job_id)
        if indices:
            self.session.execute(
                update(GpuSlot)
                .where(GpuSlot.node_id == node_id, GpuSlot.index.in_(indices))
                .values(job_id=job_id)
            )

    def reassign(self, job_ids: Sequence[int], slots: Sequence[tuple[int, int, int]]) -> None:
        """Free every slot these jobs hold, then give each (node id, slot index) its job id, in
        this order (a later entry for a slot wins): two statements however many jobs move."""
        if job_ids:
            self.session.execute(
                update(GpuSlot)
                .where(ids_in(GpuSlot.job_id, sorted(set(job_ids))))
                .values(job_id=None)
            )
        if slots:
            table = cast(Table, GpuSlot.__table__)
            self.session.execute(
                update(table)
                .where(
                    table.c.node_id == bindparam("slot_node"),
                    # `c.index` is the collection's own method: the column is `c["index"]`.
                    table.c["index"] == bindparam("slot"),
                )
                .values(job_id=bindparam("slot_job")),
                [{"slot_node": n, "slot": i, "slot_job": j} for n, i, j in slots],
            )

    def assign_parts(self, parts: Sequence[tuple[int, Sequence[int]]], job_id: int) -> None:
        """Give a job these slots on one or more nodes (after releasing what it held)."""
        self.release_job(job_id)
        for node_id, indices in parts:
            if indices:
                self.session.execute(
                    update(GpuSlot)
                    .where(GpuSlot.node_id == node_id, GpuSlot.index.in_(list(indices)))
                    .values(job_id=job_id)
                )
