"""Turn a plan's first slot into allocation commands, and record what agents acknowledged.

Every change is written to the database (and committed by the caller) before any command
leaves the scheduler, so a restart resends what was not acknowledged and loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from scheduler_service.allocation.problem import AllocationPlan
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, Job, JobEvent, Node
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import ACTIVE_STATES, TERMINAL_STATES, JobState, transition
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.placement import NodeSlots, Placement, place
from scheduler_service.planning import PlanningInput
from scheduler_service.telemetry.service import total_samples_of
from worker_agent.protocol import AllocationAck, AllocationCommand, StopCommand, WorkloadSpec


@dataclass(frozen=True)
class Delivery:
    """One command to deliver: where, with which secret, and what."""

    allocation_id: int
    agent_url: str
    secret: str
    command: AllocationCommand | StopCommand
    # 0: stops and pauses, 1: shrinks, 2: the rest — freed slots are freed before they are reused.
    order: int = 2


def _current_placements(session: Session, job_ids: list[int]) -> dict[int, Placement]:
    out: dict[int, Placement] = {}
    for job_id, slots in NodeRepository(session).slots_of_jobs(job_ids).items():
        out[job_id] = Placement(
            slots[0].node_id, tuple(s.index for s in slots if s.node_id == slots[0].node_id)
        )
    return out


def _pause_homes(
    allocations: AllocationRepository, job_ids: list[int], current: dict[int, Placement]
) -> dict[int, int]:
    """Node of each paused job's acknowledged pause: its agent holds the job's state in memory."""
    unplaced = [job_id for job_id in job_ids if job_id not in current]
    return {
        job_id: last.node_id
        for job_id, last in allocations.newest_by_job(unplaced, acked=True).items()
        if last.gpus == 0 and last.node_id is not None
    }


def _why_not_now(plan: AllocationPlan, job_id: str, budget_left_kg: float) -> str:
    later = [t for t, gpus in enumerate(plan.gpus.get(job_id, ())) if gpus > 0]
    if later:
        start = plan.start_at.timestamp() + later[0] * plan.slot_s
        return f"waiting for cleaner power: planned to run from {datetime.fromtimestamp(start).astimezone().isoformat(timespec='seconds')}"
    if budget_left_kg <= 1e-9:
        return "carbon budget of this period is spent: waiting for the next period"
    return "no capacity or budget for it within the planning horizon"


def enforce_deadlines(session: Session, now: datetime) -> list[int]:
    """Mark unfinished jobs past their deadline; return those that must stop."""
    jobs = JobRepository(session)
    stopped: list[int] = []
    for job in jobs.in_states(
        [s.value for s in (JobState.QUEUED, JobState.DEFERRED, *ACTIVE_STATES)]
    ):
        if job.deadline_at is None or job.deadline_at > now:
            continue
        if job.run_past_deadline:
            if not jobs.has_event(job.id, "deadline_missed"):
                jobs.add_event(
                    JobEvent(
                        job_id=job.id,
                        kind="deadline_missed",
                        reason="deadline passed; running on as its spec asks",
                    )
                )
            continue
        jobs.add_event(
            transition(
                job,
                JobState.DEADLINE_MISSED,
                reason=f"deadline {job.deadline_at.isoformat()} passed before the job finished",
                at=now,
            )
        )
        stopped.append(job.id)
    return stopped


def stop_finished_jobs(session: Session) -> None:
    """Queue a stop command for every terminal job an agent may still be running."""
    allocations = AllocationRepository(session)
    nodes = NodeRepository(session)
    jobs = JobRepository(session)
    # One query, not one per finished job: finished jobs pile up over the service's life.
    for last in allocations.newest_running_of_jobs_in([s.value for s in TERMINAL_STATES]):
        job = jobs.get(last.job_id)
        if job is None:
            continue
        nodes.release_job(job.id)
        job.current_gpus = 0
        allocations.add(
            Allocation(
                job_id=job.id,
                generation=last.generation + 1,
                node_id=last.node_id,
                gpus=0,
                slot_indices=[],
                status="pending",
                reason=f"stop: job is {job.state}",
            )
        )


def decide(session: Session, planning: PlanningInput, plan: AllocationPlan, now: datetime) -> int:
    """Place the plan's first slot and stage a command for every job whose placement changes."""
    first = plan.first_slot()
    targets = {int(k): v for k, v in first.items()}
    job_ids = list(targets)
    current = _current_placements(session, job_ids)
    ready = NodeRepository(session).nodes_with_slots(ready_only=True)
    nodes = [NodeSlots(n.id, tuple(s.index for s in n.slots)) for n in ready]
    allowed = {
        int(k): spec.allowed_gpus
        for k, spec in zip(planning.jobs, planning.problem.jobs, strict=True)
    }
    # Higher priority, then earlier deadline, then older first.
    order = sorted(
        job_ids,
        key=lambda j: (
            -planning.jobs[str(j)].priority,
            planning.jobs[str(j)].deadline_at or datetime.max.replace(tzinfo=now.tzinfo),
            j,
        ),
    )
    allocations = AllocationRepository(session)
    placements = place(
        targets, current, nodes, allowed, order, home=_pause_homes(allocations, job_ids, current)
    )
    budget_left = min(
        (p.budget_left_kg for p in planning.problem.budget_periods if p.start_s <= 0 < p.end_s),
        default=float("inf"),
    )
    jobs_repo = JobRepository(session)
    node_repo = NodeRepository(session)
    newest = allocations.newest_by_job(job_ids)
    changed = 0
    for job_id in order:
        job = planning.jobs[str(job_id)]
        new = placements[job_id]
        old = current.get(job_id, Placement(None, ()))
        last = newest.get(job_id)
        in_flight = last is not None and last.status in ("pending", "unreachable")
        if new == old and not (in_flight and last is not None and (last.gpus != new.gpus)):
            _note_waiting(jobs_repo, job, plan, str(job_id), new, budget_left)
            continue
        model = planning.models[str(job_id)]
        if new.node_id is not None:
            node_repo.assign(new.node_id, list(new.slot_indices), job_id)
        else:
            node_repo.release_job(job_id)
        if last is not None and last.status in ("pending", "unreachable"):
            last.status = "superseded"
        reason = f"plan: {old.gpus} -> {new.gpus} GPUs"
        allocations.add(
            Allocation(
                job_id=job_id,
                generation=last.generation + 1 if last is not None else 1,
                node_id=new.node_id if new.node_id is not None else old.node_id,
                gpus=new.gpus,
                slot_indices=list(new.slot_indices),
                estimated_power_w={str(g): w for g, w in model.power_w.items()},
                status="pending",
                reason=reason
                if new.gpus
                else f"pause: {_why_not_now(plan, str(job_id), budget_left)}",
            )
        )
        if JobState(job.state) is JobState.RUNNING:
            jobs_repo.add_event(transition(job, JobState.RESIZING, reason=reason, at=now))
        changed += 1
    return changed


def _note_waiting(
    jobs: JobRepository,
    job: Job,
    plan: AllocationPlan,
    key: str,
    placement: Placement,
    budget_left: float,
) -> None:
    if placement.gpus == 0 and JobState(job.state) is JobState.QUEUED:
        jobs.add_event(
            transition(job, JobState.DEFERRED, reason=_why_not_now(plan, key, budget_left))
        )


def deliveries(session: Session) -> list[Delivery]:
    """Every command still to deliver, with its agent's address and secret."""
    out: list[Delivery] = []
    nodes = NodeRepository(session)
    jobs = JobRepository(session)
    for allocation in AllocationRepository(session).unacknowledged():
        node: Node | None = (
            nodes.get(allocation.node_id) if allocation.node_id is not None else None
        )
        job = jobs.get(allocation.job_id)
        if job is None:
            allocation.status = "superseded"
            continue
        if node is None or node.state != "ready":
            if allocation.gpus == 0:
                # Nothing runs on a lost or unknown node: the stop is moot.
                allocation.status = "superseded"
            continue
        command: AllocationCommand | StopCommand
        if JobState(job.state) in TERMINAL_STATES:
            command = StopCommand(
                job_id=job.id, generation=allocation.generation, reason=allocation.reason
            )
        else:
            command = AllocationCommand(
                job_id=job.id,
                generation=allocation.generation,
                slot_indices=list(allocation.slot_indices),
                spec=WorkloadSpec(
                    workload=job.workload,
                    global_batch_size=job.global_batch_size,
                    total_samples=total_samples_of(
                        job.total_samples, job.total_steps, job.global_batch_size
                    ),
                    seed=job.id,
                ),
                estimated_power_w={
                    int(k): v for k, v in (allocation.estimated_power_w or {}).items()
                },
                issued_at=allocation.created_at,
            )
        allocation.sent_at = utcnow()
        allocation.attempts += 1
        acked = AllocationRepository(session).latest_acked(job.id)
        held = (
            set(acked.slot_indices)
            if acked is not None and acked.node_id == allocation.node_id
            else set()
        )
        if allocation.gpus == 0:
            order = 0
        elif set(allocation.slot_indices) <= held:
            order = 1
        else:
            order = 2
        out.append(Delivery(allocation.id, node.agent_url, node.agent_secret, command, order))
    return sorted(out, key=lambda d: (d.order, d.allocation_id))


def record_ack(session: Session, allocation_id: int, ack: AllocationAck | None) -> None:
    """Record an agent's acknowledgement and move the job's state accordingly."""
    allocations = AllocationRepository(session)
    allocation = allocations.get(allocation_id)
    if allocation is None or allocation.status == "superseded":
        return
    allocation.status = "acked"
    allocation.acked_at = utcnow()
    allocation.error = None
    jobs = JobRepository(session)
    job = jobs.get(allocation.job_id)
    if job is None or ack is None:
        return  # a stop: nothing more to record
    allocation.layout = ack.layout
    previous_gpus = job.current_gpus if JobState(job.state) in ACTIVE_STATES else 0
    job.current_gpus = ack.gpus
    job.current_layout = ack.layout
    lost_samples = _rewind_progress(job, ack)
    job.step = max(job.step, ack.step)
    state = JobState(job.state)
    if state in TERMINAL_STATES:
        return
    if ack.gpus == 0:
        if state is not JobState.DEFERRED:
            jobs.add_event(
                transition(
                    job, JobState.DEFERRED, reason=allocation.reason or "paused by the planner"
                )
            )
        return
    if ack.hot_switch:
        jobs.add_event(
            JobEvent(
                job_id=job.id,
                kind="hot_switch",
                reason=f"hot switch {previous_gpus} -> {ack.gpus} GPUs ({ack.layout}) at step {ack.step} in {ack.switch_s or 0:.2f} s",
                details={
                    "from_gpus": previous_gpus,
                    "to_gpus": ack.gpus,
                    "layout": ack.layout,
                    "step": ack.step,
                    "switch_s": ack.switch_s,
                    "bytes_moved": ack.bytes_moved,
                    "worker_pids": ack.worker_pids,
                    "generation": ack.generation,
                },
            )
        )
    else:
        jobs.add_event(
            JobEvent(
                job_id=job.id,
                kind="allocation",
                reason=f"started on {ack.gpus} GPUs ({ack.layout}) at step {ack.step}"
                + _resume_note(ack, lost_samples),
                details={
                    "gpus": ack.gpus,
                    "layout": ack.layout,
                    "step": ack.step,
                    "resumed_from": ack.resumed_from,
                    "samples_lost": lost_samples,
                    "worker_pids": ack.worker_pids,
                    "generation": ack.generation,
                },
            )
        )
    if state is not JobState.RUNNING:
        jobs.add_event(transition(job, JobState.RUNNING, reason=f"running on {ack.gpus} GPUs"))


def _rewind_progress(job: Job, ack: AllocationAck) -> int:
    """A run that started behind the recorded progress (node lost, no newer checkpoint) redoes
    the difference: progress goes back to where the agent resumed. Returns samples lost."""
    if ack.hot_switch or ack.gpus == 0 or ack.resumed_from is None:
        return 0
    resumed_samples = min(ack.step * job.global_batch_size, job.samples_done)
    lost = job.samples_done - resumed_samples
    if lost > 0:
        job.samples_done = resumed_samples
        job.step = ack.step
    return lost


def _resume_note(ack: AllocationAck, lost_samples: int) -> str:
    if ack.resumed_from is None or (ack.resumed_from == "start" and lost_samples == 0):
        return ""
    where = {"start": "step 0", "memory": "its paused state"}.get(
        ack.resumed_from, ack.resumed_from.replace("@", " at ")
    )
    lost = f"; {lost_samples} samples trained since then are redone" if lost_samples else ""
    return f", resumed from {where}{lost}"


def record_failure(session: Session, allocation_id: int, error: str, *, rejected: bool) -> None:
    """Record a failed delivery: rejected commands are final, unreachable ones are retried."""
    allocation = AllocationRepository(session).get(allocation_id)
    if allocation is None:
        return
    allocation.status = "rejected" if rejected else "unreachable"
    allocation.error = error[:2000]
    if rejected:
        job = JobRepository(session).get(allocation.job_id)
        if job is not None and JobState(job.state) is JobState.RESIZING:
            JobRepository(session).add_event(
                transition(job, JobState.RUNNING, reason=f"resize refused by agent: {error[:200]}")
            )
