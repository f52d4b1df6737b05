"""Job use-cases: submit, look up, list, cancel, hold. Never commits; the caller does."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from scheduler_service.admission import check_admission
from scheduler_service.auth.service import Principal
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Job, JobEvent
from scheduler_service.exceptions import FieldError, NotAllowed
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.schemas import JobSpec
from scheduler_service.jobs.states import (
    TERMINAL_STATES,
    InvalidTransition,
    JobState,
    initial_event,
    transition,
)
from scheduler_service.settings import GreenflowConfig


class JobNotFound(Exception):
    """No such job, or not one the caller may see (the two are indistinguishable on purpose)."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"job {job_id} not found")
        self.job_id = job_id


class SubmissionConflict(Exception):
    """A submission_id was reused with a different spec."""


@dataclass(frozen=True)
class SubmitResult:
    """The job and whether this call created it (False: an earlier submission with the same id)."""

    job: Job
    created: bool


def _spec_fields(spec: JobSpec) -> dict[str, object]:
    data = spec.model_dump(exclude={"deadline"})
    data["deadline_at"] = spec.deadline
    return data


def _same_spec(job: Job, spec: JobSpec) -> bool:
    return all(getattr(job, key) == value for key, value in _spec_fields(spec).items())


def submit_job(
    session: Session, principal: Principal, spec: JobSpec, config: GreenflowConfig | None = None
) -> SubmitResult:
    """Store a new job (or return the one already submitted under the same submission_id)."""
    repo = JobRepository(session)
    if spec.submission_id is not None:
        existing = repo.by_submission_id(principal.name, spec.submission_id)
        if existing is not None:
            if not _same_spec(existing, spec):
                raise SubmissionConflict(
                    f"submission_id {spec.submission_id!r} was already used for a different spec "
                    f"(job {existing.id})"
                )
            return SubmitResult(existing, created=False)
    now = utcnow()
    if spec.deadline is not None and spec.deadline <= now:
        raise FieldError("deadline", f"deadline {spec.deadline.isoformat()} is in the past")
    admission_note = "accepted; waiting for the planner"
    if spec.deadline is not None and config is not None:
        decision = check_admission(session, config, spec, spec.total_samples_resolved(), now)
        if not decision.admitted or not decision.guaranteed:
            if not spec.best_effort:
                raise FieldError(
                    "deadline",
                    f"rejected: the deadline cannot be met ({decision.reason}); "
                    "resubmit with a later deadline, or with best_effort: true to queue it without a guarantee",
                )
            admission_note = f"admitted best-effort, no deadline guarantee: {decision.reason}"
        else:
            admission_note = f"admitted: {decision.reason}"
    job = Job(
        owner=principal.name,
        state=JobState.PENDING.value,
        state_reason="submitted",
        created_at=now,
        updated_at=now,
        **_spec_fields(spec),
    )
    repo.add(job)
    repo.add_event(initial_event(job, reason="submitted", actor=principal.name))
    repo.add_event(transition(job, JobState.QUEUED, reason=admission_note, at=now))
    return SubmitResult(job, created=True)


def get_visible_job(session: Session, principal: Principal, job_id: int) -> Job:
    """The job if the caller may see it, else `JobNotFound`."""
    job = JobRepository(session).get(job_id)
    if job is None or (not principal.is_operator and job.owner != principal.name):
        raise JobNotFound(job_id)
    return job


def list_jobs(
    session: Session,
    principal: Principal,
    *,
    states: list[JobState],
    owner: str | None,
    queue: str | None,
    limit: int,
    offset: int,
) -> tuple[list[Job], int]:
    """Jobs the caller may see, filtered; users always see only their own."""
    if not principal.is_operator:
        if owner is not None and owner != principal.name:
            raise NotAllowed("only operators can list other owners' jobs")
        owner = principal.name
    return JobRepository(session).page(
        owner=owner, states=[s.value for s in states], queue=queue, limit=limit, offset=offset
    )


def job_events(
    session: Session, principal: Principal, job_id: int, *, limit: int, offset: int
) -> list[JobEvent]:
    """A visible job's events."""
    get_visible_job(session, principal, job_id)
    return JobRepository(session).events(job_id, limit=limit, offset=offset)


def cancel_job(session: Session, principal: Principal, job_id: int, *, reason: str) -> Job:
    """Cancel a visible job; cancelling a finished job is a conflict, not a no-op."""
    job = get_visible_job(session, principal, job_id)
    job = JobRepository(session).get(job_id, for_update=True) or job
    if JobState(job.state) in TERMINAL_STATES:
        if job.state == JobState.CANCELLED:
            return job  # repeating a cancel is harmless
        raise InvalidTransition(job.id, job.state, JobState.CANCELLED)
    JobRepository(session).add_event(
        transition(job, JobState.CANCELLED, reason=reason, actor=principal.name)
    )
    return job


def set_hold(session: Session, principal: Principal, job_id: int, *, held: bool) -> Job:
    """Hold (keep off GPUs) or release a job; operators only."""
    if not principal.is_operator:
        raise NotAllowed("only operators can hold or release jobs")
    get_visible_job(session, principal, job_id)
    job = JobRepository(session).get(job_id, for_update=True)
    assert job is not None
    if JobState(job.state) in TERMINAL_STATES:
        raise InvalidTransition(job.id, job.state, job.state)
    if job.held != held:
        job.held = held
        JobRepository(session).add_event(
            JobEvent(
                job_id=job.id,
                kind="hold" if held else "release",
                reason=("held by operator" if held else "released by operator"),
                actor=principal.name,
            )
        )
    return job


def set_priority(session: Session, principal: Principal, job_id: int, *, priority: int) -> Job:
    """Change a job's priority; operators only."""
    if not principal.is_operator:
        raise NotAllowed("only operators can change priorities")
    get_visible_job(session, principal, job_id)
    job = JobRepository(session).get(job_id, for_update=True)
    assert job is not None
    if job.priority != priority:
        JobRepository(session).add_event(
            JobEvent(
                job_id=job.id,
                kind="priority",
                reason=f"priority {job.priority} -> {priority}",
                actor=principal.name,
                details={"from": job.priority, "to": priority},
            )
        )
        job.priority = priority
    return job
