"""Node endpoints: agents register and heartbeat; operators list nodes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request

from scheduler_service.db.base import utcnow
from scheduler_service.deps import Agent, Operator, SessionDep
from scheduler_service.exceptions import error_responses
from scheduler_service.nodes import service
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.nodes.schemas import NodeOut
from worker_agent.protocol import Heartbeat, HeartbeatAck, NodeRegistered, NodeRegistration

router = APIRouter(prefix="/v1/nodes", tags=["nodes"], responses=error_responses(401, 403))

NodeNamePath = Annotated[str, Path(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")]


@router.post("/register", responses=error_responses(400))
def register(
    body: NodeRegistration, session: SessionDep, _agent: Agent, request: Request
) -> NodeRegistered:
    """Register (or re-register) an agent's node and its GPU slots."""
    result = service.register_node(session, body)
    request.app.state.wake_control_loop()
    timing = request.app.state.agent_timing
    return NodeRegistered(
        node_id=result.node.id,
        heartbeat_interval_s=timing.heartbeat_interval_s,
        telemetry_interval_s=timing.telemetry_interval_s,
    )


@router.post("/{name}/heartbeat", responses=error_responses(400, 404))
def heartbeat(
    name: NodeNamePath, body: Heartbeat, session: SessionDep, _agent: Agent, request: Request
) -> HeartbeatAck:
    """Record a heartbeat; 404 tells the agent to register again."""
    grace_s = 3 * request.app.state.agent_timing.heartbeat_interval_s
    try:
        return service.heartbeat(session, name, body, grace_s=grace_s)
    except service.UnknownNode as exc:
        raise HTTPException(
            404, detail=f"node {name} is not registered (or was marked lost): register again"
        ) from exc


@router.get("")
def list_nodes(session: SessionDep, _operator: Operator) -> list[NodeOut]:
    """Every node with its slots and heartbeat age."""
    now = utcnow()
    out = []
    for node in NodeRepository(session).nodes_with_slots():
        item = NodeOut.model_validate(node)
        if node.last_heartbeat_at is not None:
            item.heartbeat_age_s = (now - node.last_heartbeat_at).total_seconds()
        out.append(item)
    return out
