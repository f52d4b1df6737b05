"""Queries on nodes and gpu_slots."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

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

    def nodes_with_slots(self) -> list[Node]:
        """Every node with its slots loaded, by name."""
        stmt = select(Node).options(selectinload(Node.slots)).order_by(Node.name)
        return list(self.session.scalars(stmt))
