"""Job states and the one function through which every state change goes."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Job, JobEvent
from scheduler_service.exceptions import InvalidTransition


class JobState(StrEnum):
    """Lifecycle of a job."""

    PENDING = "PENDING"
    QUEUED = "QUEUED"
    DEFERRED = "DEFERRED"
    RUNNING = "RUNNING"
    RESIZING = "RESIZING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    DEADLINE_MISSED = "DEADLINE_MISSED"


TERMINAL_STATES = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.DEADLINE_MISSED}
)
ACTIVE_STATES = frozenset({JobState.RUNNING, JobState.RESIZING})

_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.QUEUED, JobState.FAILED, JobState.CANCELLED}),
    # QUEUED/DEFERRED -> SUCCEEDED: the last telemetry of a run can arrive after the job was
    # re-queued (e.g. its node was lost just as it finished).
    JobState.QUEUED: frozenset(
        {
            JobState.RUNNING,
            JobState.DEFERRED,
            JobState.SUCCEEDED,
            JobState.CANCELLED,
            JobState.FAILED,
            JobState.DEADLINE_MISSED,
        }
    ),
    JobState.DEFERRED: frozenset(
        {
            JobState.QUEUED,
            JobState.RUNNING,
            JobState.SUCCEEDED,
            JobState.CANCELLED,
            JobState.FAILED,
            JobState.DEADLINE_MISSED,
        }
    ),
    JobState.RUNNING: frozenset(
        {
            JobState.RESIZING,
            JobState.QUEUED,
            JobState.DEFERRED,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.DEADLINE_MISSED,
        }
    ),
    JobState.RESIZING: frozenset(
        {
            JobState.RUNNING,
            JobState.QUEUED,
            JobState.DEFERRED,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.DEADLINE_MISSED,
        }
    ),
}


def can_transition(from_state: JobState, to_state: JobState) -> bool:
    """Whether the lifecycle allows this change."""
    return to_state in _ALLOWED.get(from_state, frozenset())


def transition(
    job: Job,
    to_state: JobState,
    *,
    reason: str,
    actor: str = "system",
    at: datetime | None = None,
    details: dict[str, Any] | None = None,
) -> JobEvent:
    """Move `job` to `to_state` and return the event that records why (caller adds it to the session)."""
    from_state = JobState(job.state)
    if not can_transition(from_state, to_state):
        raise InvalidTransition(job.id, from_state, to_state)
    now = at or utcnow()
    job.state = to_state.value
    job.state_reason = reason
    if to_state in ACTIVE_STATES and job.started_at is None:
        job.started_at = now
    if to_state in TERMINAL_STATES:
        job.finished_at = now
    return JobEvent(
        job_id=job.id,
        at=now,
        kind="state",
        from_state=from_state.value,
        to_state=to_state.value,
        reason=reason,
        actor=actor,
        details=details,
    )


def initial_event(job: Job, *, reason: str, actor: str) -> JobEvent:
    """The event recording a job's creation in its first state."""
    return JobEvent(
        job_id=job.id,
        at=job.created_at,
        kind="state",
        from_state=None,
        to_state=job.state,
        reason=reason,
        actor=actor,
        # Every column given, as `transition` gives them: a submission's two events then share
        # one column set and go to the database as one multi-row INSERT.
        details=None,
    )


def submission_events(*, at: datetime, submitter: str, reason: str) -> list[dict[str, Any]]:
    """A new job's first two events as column values: created PENDING (by its submitter), then
    QUEUED (why: the admission's note)."""
    first = {"at": at, "kind": "state", "details": None}
    return [
        {**first, "from_state": None, "to_state": JobState.PENDING.value, "reason": "submitted",
         "actor": submitter},
        {**first, "from_state": JobState.PENDING.value, "to_state": JobState.QUEUED.value,
         "reason": reason, "actor": "system"},
    ]  # fmt: skip
