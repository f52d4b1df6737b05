"""Deadline-at-risk events: the plan shows a promised deadline will be missed (issue 23).

An admitted deadline is a promise; when a later plan no longer keeps it (a node lost, a model far
off), the job gets a `deadline_at_risk` event with the projected lateness as soon as the plan
knows, and a `deadline_on_track` event when a later plan keeps it again. Each is recorded once
per change: again only when the risk comes or goes, or the projected lateness moves by more than
a slot (not at every tick).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from sqlalchemy.orm import Session

from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem, evaluate_gpus
from scheduler_service.db.models import JobEvent
from scheduler_service.jobs.repository import JobRepository, PlanRow

DEADLINE_AT_RISK = "deadline_at_risk"
DEADLINE_ON_TRACK = "deadline_on_track"


def _aware(at: datetime) -> datetime:
    """SQLite returns naive datetimes: they are UTC."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def late_by_s(
    problem: AllocationProblem, plan: AllocationPlan, deadlines: Mapping[str, datetime]
) -> dict[str, float]:
    """Seconds past its deadline the plan finishes each job of `deadlines` it misses.

    A job the plan leaves unfinished at the horizon is projected to finish its rest at its
    fastest count right after it (a lower bound on its lateness).
    """
    late: dict[str, float] = {}
    evaluation = None
    jobs = {job.job_id: job for job in problem.jobs}
    for job_id, deadline_at in deadlines.items():
        job = jobs.get(job_id)
        if job is None or plan.deadline_met.get(job_id, True):
            continue
        finish_s = plan.completion_s.get(job_id)
        if finish_s is None:
            if evaluation is None:
                evaluation = evaluate_gpus(problem, plan.gpus)
            left = job.remaining_samples - evaluation.done_samples.get(job_id, 0.0)
            finish_s = problem.horizon_s + max(left, 0.0) / problem.usable_max_rate(job)
        deadline_s = (_aware(deadline_at) - problem.start_at).total_seconds()
        if finish_s > deadline_s:
            late[job_id] = finish_s - deadline_s
    return late


def record_deadline_risks(
    session: Session,
    problem: AllocationProblem,
    plan: AllocationPlan,
    rows: Mapping[int, PlanRow],
    now: datetime,
) -> int:
    """Record the changes in which promised deadlines `plan` misses; the events written.

    `rows`: the planned jobs' plain rows. A promise is a deadline admitted without best effort.
    """
    deadlines = {
        str(job_id): row.deadline_at
        for job_id, row in rows.items()
        if row.deadline_at is not None and not row.best_effort and str(job_id) in plan.gpus
    }
    if not deadlines:
        return 0
    late = late_by_s(problem, plan, deadlines)
    repo = JobRepository(session)
    last = repo.latest_events([int(k) for k in deadlines], (DEADLINE_AT_RISK, DEADLINE_ON_TRACK))
    written = 0
    for key in deadlines:
        job_id = int(key)
        before = last.get(job_id)
        was_late = (
            float((before.details or {}).get("projected_lateness_s", 0.0))
            if before is not None and before.kind == DEADLINE_AT_RISK
            else None
        )
        lateness = late.get(key)
        if lateness is None:
            if was_late is not None:
                repo.add_event(
                    JobEvent(
                        job_id=job_id,
                        at=now,
                        kind=DEADLINE_ON_TRACK,
                        reason="the plan meets the deadline again",
                    )
                )
                written += 1
            continue
        if was_late is not None and abs(lateness - was_late) <= problem.slot_s:
            continue
        missed = plan.missed_reasons.get(key, "")
        repo.add_event(
            JobEvent(
                job_id=job_id,
                at=now,
                kind=DEADLINE_AT_RISK,
                reason=(
                    f"the plan misses the deadline by {lateness:.0f} s"
                    + (f": {missed}" if missed else "")
                ),
                details={"projected_lateness_s": round(lateness, 1)},
            )
        )
        written += 1
    return written
