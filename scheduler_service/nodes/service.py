"""Node use-cases: registration, heartbeats, loss detection. Never commits; the caller does."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from scheduler_service.auth.repository import TokenRepository
from scheduler_service.auth.service import Principal
from scheduler_service.auth.tokens import Role
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, GpuSlot, Job, JobEvent, Node
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.exceptions import NotAllowed, UnknownNode
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import ACTIVE_STATES, TERMINAL_STATES, JobState, transition
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.nodes.secrets import NodeSecrets
from worker_agent.protocol import Heartbeat, HeartbeatAck, NodeRegistration, RunningJob

log = logging.getLogger("greenflow.nodes")


@dataclass(frozen=True)
class RegistrationResult:
    """The node row, whether it is new, and the scheduler's new secret toward its agent."""

    node: Node
    created: bool
    agent_secret: str


def check_speaks_for(principal: Principal, node_name: str) -> None:
    """A node credential speaks only for the node it is named after (403 otherwise)."""
    if principal.name != node_name:
        raise NotAllowed(
            f"this agent token is the credential of node {principal.name!r}, not of "
            f"{node_name!r}; each node needs its own (`greenflow node enrol {node_name}`)"
        )


def register_node(
    session: Session,
    principal: Principal,
    registration: NodeRegistration,
    node_secrets: NodeSecrets,
) -> RegistrationResult:
    """Create or refresh a node and its slots; a returning node is reconciled, not duplicated.

    Only the node's own credential may (re-)register it, and every registration draws a new
    secret toward the agent, so an earlier secret stops working."""
    check_speaks_for(principal, registration.name)
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
    node.agent_secret_nonce = node_secrets.new_nonce()
    node.secret_key_id = node_secrets.key_id
    node.gpu_kind = registration.gpu_kind
    node.simulated = registration.simulated
    node.rendezvous_host = registration.rendezvous_host
    node.worker_host_port = registration.worker_host_port
    node.state = "ready"
    node.last_heartbeat_at = now
    node.lost_reported_at = None  # registered again: what a runner reported is past
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
    secret = node_secrets.agent_secret(node.id, node.name, node.agent_secret_nonce)
    return RegistrationResult(node, created, secret)


def revoke_node(session: Session, name: str) -> int:
    """Revoke a node's credential and take it out of service now (its jobs go back to the
    queue); returns how many credentials were revoked."""
    revoked = 0
    for token in TokenRepository(session).active_by_name(name, Role.AGENT.value):
        token.revoked_at = utcnow()
        revoked += 1
    node = NodeRepository(session).by_name(name)
    if node is not None and node.state != "lost":
        node.state = "lost"
        requeue_jobs_of_node(session, node, reason=f"node {name}'s credential was revoked")
    return revoked


def requeue_jobs_of_node(session: Session, node: Node, *, reason: str) -> list[int]:
    """Free a node's slots and send its running jobs back to the queue with an event; a job
    across nodes frees its slots on the others too (it runs nowhere until the next plan), and
    its event says whether its runner was on the node and which other GPUs it gave up."""
    repo = NodeRepository(session)
    job_ids = repo.release_node(node.id)
    if not job_ids:
        return job_ids
    # What they hold elsewhere (this node's slots are free now), and where their runners are.
    elsewhere = repo.slots_of_jobs(job_ids)
    runners = {
        j: a.node_id
        for j, a in AllocationRepository(session).newest_by_job(job_ids).items()
        if a.node_id is not None
    }
    other_ids = {s.node_id for slots in elsewhere.values() for s in slots} | set(runners.values())
    names = {n.id: n.name for n in repo.get_many(sorted(other_ids)).values()}
    jobs = JobRepository(session)
    for job_id in job_ids:
        job = jobs.get(job_id)
        if job is None or JobState(job.state) in TERMINAL_STATES:
            continue
        freed: dict[str, list[int]] = {}
        for slot in elsewhere.get(job_id, []):
            freed.setdefault(names.get(slot.node_id, str(slot.node_id)), []).append(slot.index)
        runner = runners.get(job_id)
        details = {
            "node": node.name,
            "runner_lost": runner == node.id,
            "runner_node": names.get(runner, node.name) if runner is not None else None,
            "freed": freed,
        }
        # Left holding its other nodes' slots, a re-queued job was placed there as it sat, so
        # the plan sent it no command: it stayed queued on them for good.
        repo.release_job(job_id)
        _requeue(jobs, job, reason + _spanning_note(details), details)
    return job_ids


def _spanning_note(details: dict[str, Any]) -> str:
    """What a job across nodes lost with the node and gave up elsewhere (empty inside one)."""
    freed: dict[str, list[int]] = details["freed"]
    if not freed:
        return ""
    where = ", ".join(f"{len(ix)} on node {name}" for name, ix in freed.items())
    if details["runner_lost"]:
        return (
            f"; its runner (and rendezvous store) was there: its GPUs elsewhere ({where}) are "
            "freed and it is placed again (its start says from which checkpoint)"
        )
    return (
        f"; its part there is lost: its GPUs elsewhere ({where}; its runner on node "
        f"{details['runner_node']}) are freed too"
    )


def _requeue_job(session: Session, job_id: int, reason: str) -> None:
    NodeRepository(session).release_job(job_id)
    jobs = JobRepository(session)
    job = jobs.get(job_id)
    if job is not None and JobState(job.state) not in TERMINAL_STATES:
        _requeue(jobs, job, reason)


def _went_on_alone(session: Session, job: Job, node: Node, running: RunningJob) -> bool:
    """The job's runner node lost its workers on other nodes and went on on its own slots from
    the survivors' replicas: its slots elsewhere are freed and it holds what this node runs (the
    next tick plans from there), recorded once; whether this report changed anything."""
    repo = NodeRepository(session)
    if not repo.release_job_elsewhere(job.id, node.id):
        return False  # told already (or the job never held slots elsewhere)
    # No job spans onto them until they are heard from again (`planning.spannable_nodes`): a
    # node that just died still looks fresh for a few heartbeat intervals.
    repo.report_lost(running.lost_nodes, utcnow())
    job.current_gpus = running.gpus
    job.current_layout = running.layout
    lost = ", ".join(running.lost_nodes)
    JobRepository(session).add_event(
        JobEvent(
            job_id=job.id,
            kind="node_lost",
            reason=f"workers on node(s) {lost} lost; goes on on {running.gpus} GPU(s) of node "
            f"{node.name} from its replicas at step {running.step} (no step lost)",
            details={
                "lost_nodes": list(running.lost_nodes),
                "node": node.name,
                "gpus": running.gpus,
                "layout": running.layout,
                "step": running.step,
                "worker_pids": list(running.worker_pids),
            },
        )
    )
    return True


def _placed_here(latest: Allocation | None, job_id: int, node_id: int, held: set[int]) -> bool:
    # The command that failed to start it may have been refused, its slots moved on since.
    return job_id in held or (latest is not None and latest.node_id == node_id)


def _fail_job(session: Session, job: Job, reason: str) -> None:
    NodeRepository(session).release_job(job.id)
    job.current_gpus = 0
    job.current_layout = None
    JobRepository(session).add_event(transition(job, JobState.FAILED, reason=reason[:2000]))


def _requeue(
    jobs: JobRepository, job: Job, reason: str, details: dict[str, Any] | None = None
) -> None:
    job.current_gpus = 0
    job.current_layout = None
    if JobState(job.state) in ACTIVE_STATES:
        jobs.add_event(transition(job, JobState.QUEUED, reason=reason, details=details))
    else:
        jobs.add_event(JobEvent(job_id=job.id, kind="requeue", reason=reason, details=details))


def heartbeat(
    session: Session,
    principal: Principal,
    name: str,
    beat: Heartbeat,
    *,
    key_id: str,
    grace_s: float = 15.0,
    replan: Callable[[], None] | None = None,
) -> HeartbeatAck:
    """Record a heartbeat; tell the agent which of its jobs the scheduler no longer wants.

    `replan` is called once when the beat changed where jobs run in the database (a job went on
    alone after losing a node, failed, or went back to the queue), so the loop plans again at
    once instead of a slot later."""
    check_speaks_for(principal, name)
    repo = NodeRepository(session)
    node = repo.by_name(name)
    if node is None or node.state == "lost" or node.secret_key_id != key_id:
        # A lost node must register again so the database view is rebuilt from scratch; one
        # registered under another scheduler key (or before secrets were derived) must draw a
        # secret this scheduler can present.
        raise UnknownNode(name)
    now = utcnow()
    node.last_heartbeat_at = now
    held = {slot.job_id for slot in node.slots if slot.job_id is not None}
    # Jobs the agent accounts for: running, paused, or finished (its last telemetry completes them).
    reported = {running.job_id for running in beat.jobs if running.gpus > 0 or running.finished}
    missing = sorted(held - reported)
    # Every job the beat names or the node holds, and the newest command of each, in two
    # queries however many jobs the node runs (one per job made 256 nodes' beats a tick's load).
    wanted = sorted({running.job_id for running in beat.jobs} | set(missing))
    jobs = JobRepository(session)
    jobs_by_id = jobs.get_many(wanted)
    latest = AllocationRepository(session).newest_by_job(wanted) if wanted else {}
    stop: list[int] = []
    changed = False
    for running in beat.jobs:
        job = jobs_by_id.get(running.job_id)
        if job is None or JobState(job.state) in TERMINAL_STATES:
            stop.append(running.job_id)
            continue
        command = latest.get(running.job_id)
        if running.job_error and _placed_here(command, running.job_id, node.id, held):
            # The job's own code is broken: it would fail on every node, so it ends here.
            _fail_job(session, job, f"the job's code failed on node {node.name}: {running.error}")
            changed = True
            held.discard(running.job_id)
            stop.append(running.job_id)
            continue
        if running.job_id in held:
            if running.lost_nodes:
                changed |= _went_on_alone(session, job, node, running)
            continue
        # Not placed here: stop it only once the scheduler's command that moved it elsewhere
        # is acknowledged there (a command in flight may still be on its way to this agent).
        if (
            command is not None
            and command.status == "acked"
            and command.gpus > 0
            and command.node_id != node.id
        ):
            stop.append(running.job_id)
    # The database places these jobs here; if the agent no longer runs them (it restarted, or
    # a worker died) and no command to it is in flight, they go back to the planner. A command
    # it refused (say, the job failed there while the command was on its way) is not in flight
    # either.
    errors = {running.job_id: running.error for running in beat.jobs if running.error}
    for job_id in missing:
        command = latest.get(job_id)
        if (
            command is not None
            and command.status in ("acked", "rejected")
            and command.gpus > 0
            and command.node_id == node.id
        ):
            repo.release_job(job_id)
            changed = True
            job = jobs_by_id.get(job_id)
            if job is not None and JobState(job.state) not in TERMINAL_STATES:
                _requeue(
                    jobs,
                    job,
                    f"not running on node {node.name} any more: {errors[job_id]}"
                    if job_id in errors
                    else f"not running on node {node.name} any more (agent restarted or job "
                    "failed there)",
                )
    if changed and replan is not None:
        replan()
    return HeartbeatAck(stop_job_ids=sorted(set(stop)))


def mark_lost_nodes(
    session: Session, *, timeout_s: float, now: datetime | None = None
) -> list[Node]:
    """Mark nodes whose heartbeats stopped as lost and re-queue their jobs."""
    now = now or utcnow()
    lost = NodeRepository(session).stale_ready_nodes(now - timedelta(seconds=timeout_s))
    for node in lost:
        # Logged: at load a node whose heartbeats came late flapped lost and re-registered, and
        # nothing in the server's log said so (only its jobs' events).
        log.warning(
            "node %s lost: no heartbeat for %.0f s (last at %s)",
            node.name,
            timeout_s,
            node.last_heartbeat_at.isoformat() if node.last_heartbeat_at else "never",
        )
        node.state = "lost"
        requeue_jobs_of_node(
            session, node, reason=f"node {node.name} lost (no heartbeat for {timeout_s:.0f} s)"
        )
    return lost
