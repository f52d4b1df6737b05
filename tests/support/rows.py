"""Rows the database tests set up again and again."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from scheduler_service.db.models import GpuSlot, Node


def add_node(session: Session, name: str, slots: int, **fields: Any) -> Node:
    """A node named `name` with `slots` GPU slots (indices 0..slots-1); `fields`: other columns."""
    node = Node(name=name, agent_url=fields.pop("agent_url", "http://127.0.0.1:9"), **fields)
    session.add(node)
    session.flush()
    session.add_all(GpuSlot(node_id=node.id, index=i) for i in range(slots))
    return node
