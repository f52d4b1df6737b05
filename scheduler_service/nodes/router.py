"""Node endpoints: agents register and heartbeat; operators list nodes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Path, Request

from scheduler_service.db.base import utcnow
from scheduler_service.deps import Agent, ConfigDep, FreshAgent, Operator, SessionDep
from scheduler_service.exceptions import error_responses
from scheduler_service.nodes import service
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.nodes.schemas import NodeOut
from worker_agent.protocol import Heartbeat, HeartbeatAck, NodeRegistered, NodeRegistration

router = APIRouter(prefix="/v1/nodes", tags=["nodes"], responses=error_responses(401, 403, 429))

NodeNamePath = Annotated[str, Path(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")]


@router.post("/register", responses=error_responses(400))
def register(
    body: NodeRegistration,
    session: SessionDep,
    agent: FreshAgent,
    config: ConfigDep,
    request: Request,
) -> NodeRegistered:
    """Register (or re-register) the caller's own node and its GPU slots.

    The caller's token must be that node's credential; the answer carries a new secret the
    scheduler will present to the agent from now on."""
    result = service.register_node(session, agent, body, request.app.state.node_secrets)
    request.app.state.wake_control_loop()
    timing = request.app.state.agent_timing
    return NodeRegistered(
        node_id=result.node.id,
        heartbeat_interval_s=timing.heartbeat_interval_s,
        telemetry_interval_s=timing.telemetry_interval_s,
        agent_secret=result.agent_secret,
        idle_power_per_gpu_w=config.cluster.idle_power_per_gpu_w,
        host_power_w=config.cluster.host_power_w,
    )


@router.post("/{name}/heartbeat", responses=error_responses(400, 404))
def heartbeat(
    name: NodeNamePath,
    body: Heartbeat,
    session: SessionDep,
    agent: Agent,
    request: Request,
    after: BackgroundTasks,
) -> HeartbeatAck:
    """Record a heartbeat of the caller's own node; 404 tells the agent to register again."""
    grace_s = 3 * request.app.state.agent_timing.heartbeat_interval_s
    key_id = request.app.state.node_secrets.key_id

    def replan() -> None:
        # After the response, so after the commit: a tick woken sooner could read the jobs
        # as they were and leave the change to the next slot.
        after.add_task(request.app.state.wake_control_loop)

    return service.heartbeat(
        session, agent, name, body, key_id=key_id, grace_s=grace_s, replan=replan
    )


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
