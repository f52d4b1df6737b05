"""Node use-cases: registration, heartbeats, loss detection. Never commits; the caller does."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from scheduler_service.db.base import utcnow
from scheduler_service.db.models import GpuSlot, Job, JobEvent, Node
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import ACTIVE_STATES, TERMINAL_STATES, JobState, transition
from scheduler_service.nodes.repository import NodeRepository
from worker_agent.protocol import Heartbeat, HeartbeatAck, NodeRegistration


class UnknownNode(Exception):
    """A heartbeat from a node the scheduler does not know (it must register again)."""


@dataclass(frozen=True)
class RegistrationResult:
    """The node row and whether it is new."""

    node: Node
    created: bool


def register_node(session: Session, registration: NodeRegistration) -> RegistrationResult:
    """Create or refresh a node and its slots; a returning node is reconciled, not duplicated."""
    repo = NodeRepository(session)
    now = utcnow()
    node = repo.by_name(registration.name)
    created = node is None
    if node is None:
        node = repo.add(
            Node(name=registration.name, agent_url=registration.agent_url, registered_at=now)
        )
        existing: dict[int, GpuSlot] = {}
    else:
        existing = {slot.index: slot for slot in node.slots}
    node.agent_url = registration.agent_url
    node.agent_secret = registration.agent_secret
    node.gpu_kind = registration.gpu_kind
    node.simulated = registration.simulated
    node.state = "ready"
    node.last_heartbeat_at = now
    offered = {slot.index for slot in registration.slots}
    for info in registration.slots:
        slot = existing.get(info.index)
        if slot is None:
            repo.add_slot(
                GpuSlot(node_id=node.id, index=info.index, uuid=info.uuid, memory_mb=info.memory_mb)
            )
        else:
            slot.uuid = info.uuid
            slot.memory_mb = info.memory_mb
    for index, slot in existing.items():
        if index not in offered:
            if slot.job_id is not None:
                _requeue_job(
                    session, slot.job_id, f"GPU slot {index} of node {node.name} went away"
                )
            repo.delete_slot(slot)
    # A returning node keeps what the database places on it; its next heartbeat says what
    # really runs there, and heartbeat() reconciles the two.
    session.flush()
    return RegistrationResult(node, created)


def requeue_jobs_of_node(session: Session, node: Node, *, reason: str) -> list[int]:
    """Free a node's slots and send its running jobs back to the queue with an event."""
    job_ids = NodeRepository(session).release_node(node.id)
    jobs = JobRepository(session)
    for job_id in job_ids:
        job = jobs.get(job_id)
        if job is None or JobState(job.state) in TERMINAL_STATES:
            continue
        _requeue(jobs, job, reason)
    return job_ids


def _requeue_job(session: Session, job_id: int, reason: str) -> None:
    NodeRepository(session).release_job(job_id)
    jobs = JobRepository(session)
    job = jobs.get(job_id)
    if job is not None and JobState(job.state) not in TERMINAL_STATES:
        _requeue(jobs, job, reason)


def _requeue(jobs: JobRepository, job: Job, reason: str) -> None:
    job.current_gpus = 0
    job.current_layout = None
    if JobState(job.state) in ACTIVE_STATES:
        jobs.add_event(transition(job, JobState.QUEUED, reason=reason))
    else:
        jobs.add_event(JobEvent(job_id=job.id, kind="requeue", reason=reason))


def heartbeat(
    session: Session, name: str, beat: Heartbeat, *, grace_s: float = 15.0
) -> HeartbeatAck:
    """Record a heartbeat; tell the agent which of its jobs the scheduler no longer wants."""
    repo = NodeRepository(session)
    node = repo.by_name(name)
    if node is None or node.state == "lost":
        # A lost node must register again so the database view is rebuilt from scratch.
        raise UnknownNode(name)
    now = utcnow()
    node.last_heartbeat_at = now
    jobs = JobRepository(session)
    stop: list[int] = []
    held = {slot.job_id for slot in node.slots if slot.job_id is not None}
    # Jobs the agent accounts for: running, paused, or finished (its last telemetry completes them).
    reported = {running.job_id for running in beat.jobs if running.gpus > 0 or running.finished}
    allocations = AllocationRepository(session)
    for running in beat.jobs:
        job = jobs.get(running.job_id)
        if job is None or JobState(job.state) in TERMINAL_STATES:
            stop.append(running.job_id)
            continue
        if running.job_id in held:
            continue
        # Not placed here: stop it only once the scheduler's command that moved it elsewhere
        # is acknowledged there (a command in flight may still be on its way to this agent).
        latest = allocations.latest(running.job_id)
        if (
            latest is not None
            and latest.status == "acked"
            and latest.gpus > 0
            and latest.node_id != node.id
        ):
            stop.append(running.job_id)
    # The database places these jobs here; if the agent no longer runs them (it restarted, or
    # a worker died) and no command to it is in flight, they go back to the planner.
    for job_id in sorted(held - reported):
        latest = allocations.latest(job_id)
        if (
            latest is not None
            and latest.status == "acked"
            and latest.gpus > 0
            and latest.node_id == node.id
        ):
            _requeue_job(
                session,
                job_id,
                f"not running on node {node.name} any more (agent restarted or job failed there)",
            )
    return HeartbeatAck(stop_job_ids=sorted(set(stop)))


def mark_lost_nodes(
    session: Session, *, timeout_s: float, now: datetime | None = None
) -> list[Node]:
    """Mark nodes whose heartbeats stopped as lost and re-queue their jobs."""
    now = now or utcnow()
    lost = NodeRepository(session).stale_ready_nodes(now - timedelta(seconds=timeout_s))
    for node in lost:
        node.state = "lost"
        requeue_jobs_of_node(
            session, node, reason=f"node {node.name} lost (no heartbeat for {timeout_s:.0f} s)"
        )
    return lost
