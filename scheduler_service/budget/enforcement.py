"""Team budgets enforced: a team whose hard budget is spent for the period gets its running jobs
paused (their agents keep the state in memory) and none of its jobs planned until the next
period; every other team's jobs, and the cluster's own budget, go on as before."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from scheduler_service.budget.ledger import exhausted_hard_queues
from scheduler_service.db.models import Allocation, Job
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import ACTIVE_STATES, JobState, transition
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.settings import GreenflowConfig


def _jobs_to_pause(
    session: Session, config: GreenflowConfig, now: datetime
) -> tuple[list[Job], dict[int, Allocation]]:
    """Running jobs of spent hard team budgets with no pause on its way, and their newest commands."""
    if not config.budget.teams:
        return [], {}
    exhausted = exhausted_hard_queues(session, config, now)
    if not exhausted:
        return [], {}
    running = [
        job
        for job in JobRepository(session).in_states([s.value for s in ACTIVE_STATES])
        if job.queue in exhausted and job.current_gpus > 0
    ]
    if not running:
        return [], {}
    newest = AllocationRepository(session).newest_by_job([job.id for job in running])
    waiting = [
        job
        for job in running
        if not (
            (last := newest.get(job.id)) is not None
            and last.gpus == 0
            and last.status in ("pending", "unreachable")
        )
    ]
    return waiting, newest


def team_budget_wake_reason(session: Session, config: GreenflowConfig, now: datetime) -> str | None:
    """Why the budget watchdog should wake the tick now: a team's hard budget is spent while
    its jobs still run (None once their pauses are on the way)."""
    jobs, _ = _jobs_to_pause(session, config, now)
    if not jobs:
        return None
    teams = sorted({str(config.budget.team_of(job.queue)) for job in jobs})
    return f"hard budget of team(s) {', '.join(teams)} spent while {len(jobs)} job(s) run"


def pause_jobs_over_team_budget(
    session: Session, config: GreenflowConfig, now: datetime
) -> list[int]:
    """Queue a pause for every running job of a queue whose team's hard budget is spent; return
    their ids. (The snapshot leaves those queues' jobs out of planning: `exhausted_hard_queues`.)"""
    running, newest = _jobs_to_pause(session, config, now)
    jobs = JobRepository(session)
    allocations = AllocationRepository(session)
    nodes = NodeRepository(session)
    paused: list[int] = []
    for job in running:
        last = newest.get(job.id)
        team = config.budget.team_of(job.queue)
        reason = f"pause: team {team!r}'s hard carbon budget for this period is spent"
        if last is not None and last.status in ("pending", "unreachable"):
            last.status = "superseded"
        nodes.release_job(job.id)
        allocations.add(
            Allocation(
                job_id=job.id,
                generation=last.generation + 1 if last is not None else 1,
                node_id=last.node_id if last is not None else None,
                gpus=0,
                slot_indices=[],
                estimated_power_w=last.estimated_power_w if last is not None else None,
                status="pending",
                reason=reason,
            )
        )
        if JobState(job.state) is JobState.RUNNING:
            jobs.add_event(transition(job, JobState.RESIZING, reason=reason, at=now))
        paused.append(job.id)
    return paused
