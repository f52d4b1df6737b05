"""Turn a plan's first slot into allocation commands, and record what agents acknowledged.

Every change is written to the database (and committed by the caller) before any command
leaves the scheduler, so a restart resends what was not acknowledged and loses nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from datetime import datetime

from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.exc import StaleDataError

from scheduler_service.allocation.problem import AllocationPlan
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, Job, JobEvent, Node
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.jobs.repository import JobRepository, PlanRow
from scheduler_service.jobs.states import ACTIVE_STATES, TERMINAL_STATES, JobState, transition
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.nodes.secrets import NodeSecrets
from scheduler_service.placement import (
    NOWHERE,
    NodeFacts,
    Placed,
    Placement,
    job_placement,
    tp_degree,
)
from scheduler_service.planning import PlanningInput, node_facts, plan_facts, spannable_nodes
from scheduler_service.telemetry.service import total_samples_of
from worker_agent.protocol import (
    AllocationAck,
    AllocationCommand,
    RemotePart,
    StopCommand,
    WorkloadSpec,
    worker_grant,
)


@dataclass(frozen=True)
class Delivery:
    """One command to deliver: where, with which secret, and what."""

    allocation_id: int
    agent_url: str
    secret: str
    command: AllocationCommand | StopCommand
    # 0: stops and pauses, 1: shrinks, 2: the rest — freed slots are freed before they are reused.
    order: int = 2
    # A newer command of the same job waits until this one is answered (a move's pause, before
    # the start on the new node): the loop delivers again once this round is answered.
    blocks: bool = False


def _current_placements(
    session: Session, job_ids: list[int], newest: dict[int, Allocation]
) -> dict[int, Placement]:
    """Where each job holds slots (`placement.job_placement`: its newest command's node first)."""
    out: dict[int, Placement] = {}
    for job_id, slots in NodeRepository(session).slots_of_jobs(job_ids).items():
        by_node: dict[int, list[int]] = {}
        for slot in slots:
            by_node.setdefault(slot.node_id, []).append(slot.index)
        last = newest.get(job_id)
        out[job_id] = job_placement(by_node, last.node_id if last is not None else None)
    return out


def _why_not_now(plan: AllocationPlan, job_id: str, budget_left_kg: float) -> str:
    row = plan.gpus.get(job_id, ())
    # any() first, in C: most jobs deferred after a burst get no GPUs in the whole horizon.
    if any(row):
        first = next(t for t, gpus in enumerate(row) if gpus > 0)
        start = plan.start_at.timestamp() + first * plan.slot_s
        return f"waiting for cleaner power: planned to run from {datetime.fromtimestamp(start).astimezone().isoformat(timespec='seconds')}"
    if job_id in plan.team_cut:
        return (
            f"team '{plan.team_cut[job_id]}' hard carbon budget: what is left this period pays"
            " for no more of its jobs' GPUs"
        )
    if budget_left_kg <= 1e-9:
        return "carbon budget of this period is spent: waiting for the next period"
    return "no capacity or budget for it within the planning horizon"


def enforce_deadlines(session: Session, now: datetime) -> list[int]:
    """Mark unfinished jobs past their deadline; return those that must stop."""
    jobs = JobRepository(session)
    stopped: list[int] = []
    # Only the jobs whose deadline has passed (indexed), not every unfinished job each tick.
    due = jobs.in_states(
        [s.value for s in (JobState.QUEUED, JobState.DEFERRED, *ACTIVE_STATES)], deadline_by=now
    )
    noted = jobs.with_event([job.id for job in due if job.run_past_deadline], "deadline_missed")
    for job in due:
        if job.deadline_at is None or job.deadline_at > now:
            continue
        if job.run_past_deadline:
            if job.id not in noted:
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
        session.add(
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


def planned_rows(
    session: Session, planning: PlanningInput, job_ids: Collection[int] | None = None
) -> dict[int, Job]:
    """The planned jobs' rows (those of `job_ids` only, when given) read again and locked in the
    writing transaction.

    A row whose plan facts (state, hold, priority, deadline, GPU range) changed since the
    snapshot is held to the version the snapshot read, so writing it fails this transaction's
    flush with StaleDataError and the loop plans again; a row that only made progress
    (telemetry) is written as read now, so running jobs reporting every few seconds do not
    turn every tick into a re-plan.
    """
    # Locked until the plan is written: telemetry's progress writes to these rows wait the
    # moment it takes, instead of failing this write at its flush (at 1,000 jobs reporting every
    # 5 s, some written row always changed in between and the tick re-planned until it backed off).
    wanted = [int(key) for key in planning.jobs] if job_ids is None else sorted(job_ids)
    rows = JobRepository(session).get_many(wanted, for_update=True)
    for job_id in wanted:
        job = planning.jobs[str(job_id)]
        row = rows.get(job_id)
        if row is None:
            raise StaleDataError(f"job {job.job_id} was deleted while the tick planned")
        if row.version != job.version and plan_facts(row) != job.facts:
            # The UPDATE then says WHERE version = <the snapshot's>, which matches no row.
            set_committed_value(row, "version", job.version)
    return rows


def planned_plain_rows(session: Session, planning: PlanningInput) -> dict[int, PlanRow]:
    """The planned jobs' columns as they are now, as plain rows: nothing loaded or locked (the
    write step then locks only the rows it writes, `planned_rows`)."""
    rows = JobRepository(session).plan_rows_of([int(key) for key in planning.jobs])
    for key, job in planning.jobs.items():
        if int(key) not in rows:
            raise StaleDataError(f"job {job.job_id} was deleted while the tick planned")
    return rows


def decide(
    session: Session,
    planning: PlanningInput,
    plan: AllocationPlan,
    now: datetime,
    rows: Mapping[int, PlanRow] | None = None,
    span_fresh_s: float | None = None,
    move_running: bool = False,
) -> int:
    """Place the plan's first slot and stage a command for every job whose placement changes.

    `rows`: the planned jobs' plain rows (`planned_plain_rows`); only the jobs written (their
    placement changes, or a queued one is deferred) are loaded and locked.
    `span_fresh_s`: a job spans onto a node only if it heard from it this recently (a node that
    just died under a spanning job is not chosen again while its heartbeats time out)."""
    if rows is None:
        rows = planned_plain_rows(session, planning)
    first = plan.first_slot()
    targets = {int(k): v for k, v in first.items()}
    job_ids = list(targets)
    allocations = AllocationRepository(session)
    # One read of the newest command and the newest acknowledged one of every planned job.
    newest, newest_acked = allocations.newest_and_newest_acked(job_ids)
    facts = loop_node_facts(
        session, job_ids, rows, newest, newest_acked, now, span_fresh_s, move_running
    )
    current = facts.current
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
    # The loop's placement (`NodeFacts.place`): a job that fits on no single node spans nodes
    # that advertised a rendezvous address (its TP groups stay inside a node); a count that fits
    # on no node as jobs sit gets a node made whole by placing jobs without slots elsewhere; a
    # count it cannot hold comes back lowered with the reason, which the command and the job's
    # event carry.
    placed = facts.place(targets, allowed, order)
    placements = placed.placements
    # Only the jobs this tick writes are loaded and locked (in one query): at 5,000 queued jobs
    # loading and locking every planned row was most of the write step, and nearly all of them
    # keep their placement. Which ones is decided from the plain rows; the locked row decides
    # what is written.
    moving = {j for j in job_ids if _moves(placements[j], current.get(j), newest.get(j))}
    deferring = {
        j
        for j in job_ids
        if j not in moving
        and placements[j].gpus == 0
        and j in rows
        and JobState(rows[j].state) is JobState.QUEUED
    }
    locked = planned_rows(session, planning, moving)
    budget_left = min(
        (p.budget_left_kg for p in planning.problem.budget_periods if p.start_s <= 0 < p.end_s),
        default=float("inf"),
    )
    jobs_repo = JobRepository(session)
    node_repo = NodeRepository(session)
    changed = 0
    # The slots of every moved job are written after the loop, in two statements (release, then
    # assign in this order), and nothing is flushed meanwhile: one UPDATE pair and one flush per
    # job made the write step grow with the jobs moved (512 of them: 2,000 round trips).
    moved: list[int] = []
    assigned: list[tuple[int, int, int]] = []  # (node id, slot index, job id)
    with session.no_autoflush:
        for job_id in order:
            if job_id in moving:
                changed += _decide_job(
                    session, locked[job_id], placements, current, newest, planning, plan, now,
                    placed, budget_left, jobs_repo, moved, assigned,
                )  # fmt: skip
    node_repo.reassign(moved, assigned)
    _defer(jobs_repo, planning, rows, deferring, plan, placed, budget_left, now)
    return changed


def loop_node_facts(
    session: Session,
    job_ids: list[int],
    rows: Mapping[int, PlanRow],
    newest: dict[int, Allocation],
    newest_acked: Mapping[int, Allocation],
    now: datetime,
    span_fresh_s: float | None,
    move_running: bool = False,
) -> NodeFacts:
    """What the loop places the planned jobs on (`node_facts`), read in the writing transaction:
    admission's check places plans on the same facts, read by its snapshot (`planning`)."""
    ready = NodeRepository(session).nodes_with_slots(ready_only=True)
    return node_facts(
        ready,
        _current_placements(session, job_ids, newest),
        newest_acked,
        {j: d for j in job_ids if j in rows and (d := tp_degree(rows[j].current_layout)) > 1},
        spannable_nodes(ready, now, span_fresh_s),
        job_ids,
        move_running,
    )


def _moves(new: Placement, old: Placement | None, last: Allocation | None) -> bool:
    """Whether a job's placement changes: it moves, or a command still in flight asks another
    count than the plan's."""
    in_flight = last is not None and last.status in ("pending", "unreachable")
    return new != (old or NOWHERE) or (in_flight and last is not None and last.gpus != new.gpus)


def _decide_job(
    session: Session,
    job: Job,
    placements: dict[int, Placement],
    current: Mapping[int, Placement],
    newest: dict[int, Allocation],
    planning: PlanningInput,
    plan: AllocationPlan,
    now: datetime,
    placed: Placed,
    budget_left: float,
    jobs_repo: JobRepository,
    moved: list[int],
    assigned: list[tuple[int, int, int]],
) -> int:
    """Stage the command and event of one planned job whose placement changes (1)."""
    job_id = job.id
    new = placements[job_id]
    old = current.get(job_id, NOWHERE)
    last = newest.get(job_id)
    model = planning.models[str(job_id)]
    moved.append(job_id)
    if new.node_id is not None:
        assigned.extend((node_id, index, job_id) for node_id, ix in new.parts for index in ix)
    if last is not None and last.status in ("pending", "unreachable"):
        last.status = "superseded"
    generation = last.generation + 1 if last is not None else 1
    reason = f"plan: {old.gpus} -> {new.gpus} GPUs"
    if new.others:
        reason += f" on {len(new.parts)} nodes"
    if job_id in placed.short:
        reason += f" ({placed.short[job_id]})"
    if old.node_id is not None and new.node_id is not None and new.node_id != old.node_id:
        # A running job moved to another node (`placed.moved`): first paused on its node (its
        # agent checkpoints it there and frees the slots), then started on the new node from
        # that checkpoint; `deliveries` holds the start back until the pause is answered.
        session.add(
            Allocation(
                job_id=job_id,
                generation=generation,
                node_id=old.node_id,
                gpus=0,
                slot_indices=[],
                status="pending",
                reason=f"move: paused on node {old.node_id} to resume on node {new.node_id} "
                f"({placed.moved.get(job_id, 'placement')})",
            )
        )
        generation += 1
    if job_id in placed.moved:
        # Moved to make room for another job's planned count: it resumes on its new node from
        # its newest checkpoint, not its paused state (the start's event says from where, and
        # what is trained again).
        reason += f"; {placed.moved[job_id]}"
        jobs_repo.add_event(
            JobEvent(
                job_id=job_id,
                kind="placement_move",
                reason=f"placement: {placed.moved[job_id]}",
                details={"node": new.node_id, "gpus": new.gpus, "generation": generation},
            )
        )
    session.add(
        Allocation(
            job_id=job_id,
            generation=generation,
            node_id=new.node_id if new.node_id is not None else old.node_id,
            gpus=new.gpus,
            slot_indices=list(new.slot_indices),
            parts=[[n, list(ix)] for n, ix in new.others] or None,
            estimated_power_w={str(g): w for g, w in model.power_w.items()},
            status="pending",
            reason=reason if new.gpus else f"pause: {_why_not_now(plan, str(job_id), budget_left)}",
        )
    )
    if JobState(job.state) is JobState.RUNNING:
        jobs_repo.add_event(transition(job, JobState.RESIZING, reason=reason, at=now))
    return 1


def _defer(
    jobs: JobRepository,
    planning: PlanningInput,
    rows: Mapping[int, PlanRow],
    deferring: Collection[int],
    plan: AllocationPlan,
    placed: Placed,
    budget_left: float,
    now: datetime,
) -> None:
    """Queued jobs the plan gives no GPUs now become DEFERRED with the reason, all in one
    UPDATE: one ORM row and UPDATE each made the tick after a burst of 5,000 submissions write
    for seconds. A job whose plan facts changed since the snapshot fails the tick's write (the
    loop plans again), as a written ORM row does."""
    for job_id in deferring:
        if plan_facts(rows[job_id]) != planning.jobs[str(job_id)].facts:
            raise StaleDataError(f"job {job_id} changed while the tick planned")
    reasons = {
        # The plan gave it GPUs that placement could not find on any node: say so.
        job_id: f"placement: {placed.short[job_id]}"
        if placed.short.get(job_id)
        else _why_not_now(plan, str(job_id), budget_left)
        for job_id in deferring
    }
    jobs.defer_queued(reasons, {job_id: rows[job_id].version for job_id in deferring}, now)


def deliveries(session: Session, node_secrets: NodeSecrets) -> list[Delivery]:
    """Every command still to deliver, with its agent's address and secret."""
    out: list[Delivery] = []
    allocations = AllocationRepository(session)
    pending = allocations.unacknowledged()
    # Three queries for all of them, not three per command (a plan can move a thousand jobs).
    job_ids = sorted({a.job_id for a in pending})
    jobs = JobRepository(session).get_many(job_ids)
    nodes = NodeRepository(session).get_many(
        sorted(
            {a.node_id for a in pending if a.node_id}
            | {int(n) for a in pending for n, _ in (a.parts or [])}
        )
    )
    last_acked = allocations.newest_by_job(job_ids, acked=True) if job_ids else {}
    # Jobs with an older command still undelivered: a newer one waits behind it (a move's start
    # behind its pause on the old node, which must free the slots and write the checkpoint).
    waiting: dict[int, Delivery | None] = {}
    for allocation in pending:
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
            else:
                waiting.setdefault(allocation.job_id, None)
            continue
        if allocation.job_id in waiting:
            ahead = waiting[allocation.job_id]
            if ahead is not None:
                waiting[allocation.job_id] = None
                out[out.index(ahead)] = replace(ahead, blocks=True)
            continue
        waiting[allocation.job_id] = None
        if node.secret_key_id != node_secrets.key_id or not node.agent_secret_nonce:
            # Registered under another scheduler key: its next heartbeat is told to register
            # again, which draws a secret this scheduler can present; the command waits.
            continue
        command: AllocationCommand | StopCommand
        remote = _remote_parts(allocation, nodes, node, node_secrets)
        if remote is None:
            continue  # a further node of the job is not ready (yet): the command waits
        if JobState(job.state) in TERMINAL_STATES:
            command = StopCommand(
                job_id=job.id, generation=allocation.generation, reason=allocation.reason
            )
        else:
            command = AllocationCommand(
                job_id=job.id,
                generation=allocation.generation,
                slot_indices=list(allocation.slot_indices),
                remote=remote,
                spec=WorkloadSpec(
                    workload=job.workload,
                    global_batch_size=job.global_batch_size,
                    total_samples=total_samples_of(
                        job.total_samples, job.total_steps, job.global_batch_size
                    ),
                    seed=job.id,
                    bundle_sha256=job.bundle_sha256,
                    options=dict(job.options or {}),
                    job_created_at=job.created_at,
                    init_from=job.init_from,
                ),
                estimated_power_w={
                    int(k): v for k, v in (allocation.estimated_power_w or {}).items()
                },
                issued_at=allocation.created_at,
            )
        allocation.sent_at = utcnow()
        allocation.attempts += 1
        acked = last_acked.get(job.id)
        held = (
            _slots_of(acked) if acked is not None and acked.node_id == allocation.node_id else set()
        )
        if allocation.gpus == 0:
            order = 0
        elif _slots_of(allocation) <= held:
            order = 1
        else:
            order = 2
        secret = node_secrets.agent_secret(node.id, node.name, node.agent_secret_nonce)
        out.append(Delivery(allocation.id, node.agent_url, secret, command, order))
        waiting[allocation.job_id] = out[-1]
    return sorted(out, key=lambda d: (d.order, d.allocation_id))


def _slots_of(allocation: Allocation) -> set[tuple[int | None, int]]:
    """Every (node, slot) an allocation gives its job."""
    out = {(allocation.node_id, i) for i in allocation.slot_indices}
    for node_id, indices in allocation.parts or []:
        out |= {(int(node_id), int(i)) for i in indices}
    return out


def _remote_parts(
    allocation: Allocation, nodes: dict[int, Node], runner: Node, node_secrets: NodeSecrets
) -> list[RemotePart] | None:
    """The job's parts on further nodes as the command to `runner` names them, each with its
    grant; None while one of those nodes is not ready, has no address the others reach, or was
    registered under another scheduler key."""
    out: list[RemotePart] = []
    for node_id, indices in allocation.parts or []:
        node = nodes.get(int(node_id))
        if (
            node is None
            or node.state != "ready"
            or not node.rendezvous_host
            or not node.worker_host_port
            or node.secret_key_id != node_secrets.key_id
            or not node.agent_secret_nonce
        ):
            return None
        secret = node_secrets.agent_secret(node.id, node.name, node.agent_secret_nonce)
        out.append(
            RemotePart(
                node=node.name,
                host=node.rendezvous_host,
                port=node.worker_host_port,
                slot_indices=[int(i) for i in indices],
                grant=worker_grant(secret, allocation.job_id, runner.name),
            )
        )
    return out


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
    # From the session when `prefetch_answers` read it in this transaction (no query per ack).
    job = session.get(Job, allocation.job_id)
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
    elif ack.resumed_from is not None:  # None: the job was already running on these slots
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


def prefetch_answers(
    session: Session, allocation_ids: Collection[int]
) -> tuple[dict[int, Allocation], dict[int, Job]]:
    """Read the commands answered together, and their jobs, in two queries: recording each
    answer then finds them in the session (a plan that moves 2,000 jobs is answered at once).
    The caller keeps what this returns until it has recorded them: the session holds unchanged
    objects only weakly.

    The jobs are locked (PostgreSQL; in id order, as telemetry locks them): telemetry's progress
    writes to them wait the moment recording takes. Read unlocked, a batch of hundreds of
    answers nearly always met a job that reported meanwhile, failed its flush on the version,
    and was recorded again one transaction per answer (at 5,000 jobs, 559 commands: 10 s)."""
    allocations = AllocationRepository(session).get_many(allocation_ids)
    jobs = JobRepository(session).get_many(
        sorted({a.job_id for a in allocations.values()}), for_update=True
    )
    return allocations, jobs


def record_failure(session: Session, allocation_id: int, error: str, *, rejected: bool) -> None:
    """Record a failed delivery: rejected commands are final, unreachable ones are retried."""
    allocation = AllocationRepository(session).get(allocation_id)
    if allocation is None:
        return
    allocation.status = "rejected" if rejected else "unreachable"
    allocation.error = error[:2000]
    if rejected:
        withdrawn = _withdraw_move(session, allocation)
        _restore_acked_slots(session, allocation, newer_withdrawn=withdrawn)
        job = JobRepository(session).get(allocation.job_id)
        if job is not None and JobState(job.state) is JobState.RESIZING:
            JobRepository(session).add_event(
                transition(job, JobState.RUNNING, reason=f"resize refused by agent: {error[:200]}")
            )


def _withdraw_move(session: Session, refused: Allocation) -> bool:
    """A refused pause withdraws the job's newer commands still undelivered (a move's start on
    another node: the job still runs where the pause was refused); whether any was."""
    if refused.gpus != 0:
        return False
    newer = [
        a
        for a in AllocationRepository(session).unacknowledged(refused.job_id)
        if a.generation > refused.generation
    ]
    for allocation in newer:
        allocation.status = "superseded"
    return bool(newer)


def _restore_acked_slots(
    session: Session, refused: Allocation, *, newer_withdrawn: bool = False
) -> None:
    """After an agent refused a job's newest command, the job holds again the slots of its
    newest acknowledged one: what the agent still runs.

    The tick that staged the refused command gave the job its slots at once; left so, the next
    tick would see the job already placed as planned and never send it again, while the agent
    ran it on its old slots (or not at all) and the new ones stayed idle."""
    newest_of, acked_of = AllocationRepository(session).newest_and_newest_acked([refused.job_id])
    newest = newest_of.get(refused.job_id)
    if newest is not None and newest.id != refused.id and not newer_withdrawn:
        return  # a newer command already decides where the job goes
    nodes = NodeRepository(session)
    acked = acked_of.get(refused.job_id)
    if acked is None or acked.gpus == 0 or acked.node_id is None:
        nodes.release_job(refused.job_id)
        return
    parts = [(acked.node_id, list(acked.slot_indices))]
    parts += [(int(node_id), list(indices)) for node_id, indices in acked.parts or []]
    ready = {
        n.id for n in nodes.get_many(sorted({n for n, _ in parts})).values() if n.state == "ready"
    }
    # The agent's truth wins over a slot the same tick gave another job: that job's own
    # command is then refused by the agent in turn and rolled back the same way.
    nodes.assign_parts([(n, ix) for n, ix in parts if n in ready], refused.job_id)
