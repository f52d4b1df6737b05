"""Job use-cases: submit, look up, list, cancel, hold. Never commits; the caller does."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, event
from sqlalchemy.orm import Session

from scheduler_service.admission import Admission, AdmissionResult
from scheduler_service.auth.service import Principal
from scheduler_service.bundles.service import require_bundle
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Job, JobEvent
from scheduler_service.exceptions import (
    FieldError,
    InvalidTransition,
    JobNotFound,
    NotAllowed,
    SubmissionConflict,
)
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.schemas import INIT_FROM_JOB, JobSpec
from scheduler_service.jobs.states import (
    TERMINAL_STATES,
    JobState,
    submission_events,
    transition,
)
from scheduler_service.settings import GreenflowConfig
from worker_agent.protocol import MODULE_PRESETS, WORKLOAD_PRESETS


@dataclass(frozen=True)
class SubmitResult:
    """The job and whether this call created it (False: an earlier submission with the same id)."""

    # The ORM object of an earlier submission; the stored row (read like a Job) of a new one.
    job: Job | Row[Any]
    created: bool


def _spec_fields(spec: JobSpec) -> dict[str, object]:
    data = spec.model_dump(exclude={"deadline", "bundle"})
    data["deadline_at"] = spec.deadline
    data["bundle_sha256"] = spec.bundle
    return data


def _same_spec(job: Job, spec: JobSpec) -> bool:
    return all(getattr(job, key) == value for key, value in _spec_fields(spec).items())


def submit_job(
    session: Session,
    principal: Principal,
    spec: JobSpec,
    config: GreenflowConfig | None = None,
    admission: Admission | None = None,
    *,
    look_up: bool = True,
) -> SubmitResult:
    """Store a new job (or return the one already submitted under the same submission_id).

    A deadline is checked by `admission` (the app's: one check at a time, incremental), or by a
    full check of its own when none is given. With `look_up=False` an earlier submission under
    the same submission_id is not looked for first: the insert then fails on the unique index
    (IntegrityError) and the caller redoes the unit of work with `look_up=True`."""
    if spec.deadline is not None and config is not None:
        # The check holds an admitted job's promise until the job is stored (or not), so the
        # next check counts it while this submission commits.
        admission = admission or Admission(config)
        return _submit(session, principal, spec, config, admission, look_up=True)
    return _submit(session, principal, spec, config, None, look_up=look_up)


def _submit(
    session: Session,
    principal: Principal,
    spec: JobSpec,
    config: GreenflowConfig | None,
    admission: Admission | None,
    *,
    look_up: bool,
) -> SubmitResult:
    repo = JobRepository(session)
    if spec.submission_id is not None and look_up:
        existing = repo.by_submission_id(principal.name, spec.submission_id)
        if existing is not None:
            if not _same_spec(existing, spec):
                raise SubmissionConflict(
                    f"submission_id {spec.submission_id!r} was already used for a different spec "
                    f"(job {existing.id})"
                )
            return SubmitResult(existing, created=False)
    if (
        config is not None
        and spec.workload not in WORKLOAD_PRESETS
        and not config.workloads.allows(spec.workload, spec.queue)
    ):
        raise FieldError(
            "workload",
            f"entrypoint {spec.workload!r} is not allowed on queue {spec.queue!r}: the "
            "operator allows the presets and the [workloads] entrypoints of greenflow.toml",
        )
    if spec.bundle is not None:
        require_bundle(session, spec.bundle)
    if spec.init_from is not None:
        require_init_source(session, principal, spec.init_from)
    now = utcnow()
    if spec.deadline is not None and spec.deadline <= now:
        raise FieldError("deadline", f"deadline {spec.deadline.isoformat()} is in the past")
    admitted: AdmissionResult | None = None
    if spec.deadline is not None and admission is not None:
        admitted = admission.check(session, spec, spec.total_samples_resolved(), now)
    try:
        job = _insert_admitted(repo, principal, spec, now, admitted)
    except BaseException:
        if admitted is not None and admission is not None:
            admission.withdraw(admitted)
        raise
    if admitted is not None and admission is not None:
        admission.bind(job.id, admitted)
        # A submission rolled back after this (its request failed) leaves no promise behind.
        event.listen(session, "after_rollback", lambda _: admission.forget(job.id), once=True)
    return SubmitResult(job, created=True)


def _insert_admitted(
    repo: JobRepository,
    principal: Principal,
    spec: JobSpec,
    now: datetime,
    admitted: AdmissionResult | None,
) -> Row[Any]:
    """Store the job QUEUED with the admission's note, or raise the admission's rejection."""
    admission_note = "accepted; waiting for the planner"
    if admitted is not None:
        decision = admitted.decision
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
    # The job is inserted QUEUED with both events (created PENDING, then queued and why) as column
    # values: two INSERTs and no ORM unit of work, the cheapest write of a submission.
    return repo.insert_submitted(
        {
            "owner": principal.name,
            "state": JobState.QUEUED.value,
            "state_reason": admission_note,
            "created_at": now,
            "updated_at": now,
            "version": 1,
            **_spec_fields(spec),
        },
        submission_events(at=now, submitter=principal.name, reason=admission_note),
    )


def require_init_source(session: Session, principal: Principal, init_from: str) -> None:
    """A 422 naming `init_from` unless `job:<id>` names a SUCCEEDED entrypoint job the caller
    may see (its export exists); a path is checked by the agent when the job starts."""
    match = INIT_FROM_JOB.match(init_from)
    if match is None:
        return
    source_id = int(match.group(1))
    try:
        source = get_visible_job(session, principal, source_id)
    except JobNotFound:
        raise FieldError("init_from", f"job {source_id} does not exist or is not yours") from None
    if source.workload in WORKLOAD_PRESETS and source.workload not in MODULE_PRESETS:
        raise FieldError(
            "init_from",
            f"job {source_id} runs the preset {source.workload!r}: only model jobs "
            "(entrypoints and model presets) are exported",
        )
    if source.state != JobState.SUCCEEDED.value:
        raise FieldError(
            "init_from", f"job {source_id} is {source.state}: only a SUCCEEDED job has an export"
        )


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


def _lock_unfinished_for_operator(
    session: Session, principal: Principal, job_id: int, denied: str
) -> Job:
    """The job, row-locked, for an operator's change: NotAllowed (`denied`) for anyone else,
    a conflict when it has finished (a finished job is immutable)."""
    if not principal.is_operator:
        raise NotAllowed(denied)
    get_visible_job(session, principal, job_id)
    job = JobRepository(session).get(job_id, for_update=True)
    assert job is not None
    if JobState(job.state) in TERMINAL_STATES:
        raise InvalidTransition(job.id, job.state, job.state)
    return job


def set_hold(session: Session, principal: Principal, job_id: int, *, held: bool) -> Job:
    """Hold (keep off GPUs) or release a job; operators only."""
    job = _lock_unfinished_for_operator(
        session, principal, job_id, "only operators can hold or release jobs"
    )
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


def set_gpu_range(
    session: Session, principal: Principal, job_id: int, *, min_gpus: int, max_gpus: int
) -> Job:
    """Change the GPUs a job may run on; operators only. The next plan keeps within the new
    range, so a running job outside it is hot-switched (or paused, if the planner cannot give
    it min_gpus now). The admission's deadline check is not redone."""
    job = _lock_unfinished_for_operator(
        session, principal, job_id, "only operators can change the GPUs a job may use"
    )
    if (job.min_gpus, job.max_gpus) != (min_gpus, max_gpus):
        JobRepository(session).add_event(
            JobEvent(
                job_id=job.id,
                kind="gpu_range",
                reason=f"GPUs allowed {job.min_gpus}-{job.max_gpus} -> {min_gpus}-{max_gpus}",
                actor=principal.name,
                details={
                    "from": [job.min_gpus, job.max_gpus],
                    "to": [min_gpus, max_gpus],
                },
            )
        )
        job.min_gpus, job.max_gpus = min_gpus, max_gpus
    return job


def set_priority(session: Session, principal: Principal, job_id: int, *, priority: int) -> Job:
    """Change a job's priority; operators only."""
    job = _lock_unfinished_for_operator(
        session, principal, job_id, "only operators can change priorities"
    )
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
