"""Telemetry ingestion: store samples once, advance job progress, finish done jobs."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from scheduler_service.db.models import TelemetrySample as TelemetryRow
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import TERMINAL_STATES, JobState, transition
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.telemetry.repository import TelemetryRepository
from worker_agent.protocol import TelemetryReport


@dataclass(frozen=True)
class IngestResult:
    """How many samples were new, how many repeats, and which jobs finished."""

    stored: int
    duplicates: int
    finished_job_ids: list[int]


def total_samples_of(
    total_samples: int | None, total_steps: int | None, global_batch_size: int
) -> int:
    """A job's work in samples, whichever way its spec gave it."""
    if total_samples is not None:
        return total_samples
    return (total_steps or 0) * global_batch_size


def ingest(session: Session, report: TelemetryReport) -> IngestResult:
    """Store new samples (retries are no-ops), move progress forward, mark finished jobs."""
    node = NodeRepository(session).by_name(report.node) if report.node else None
    repo = TelemetryRepository(session)
    jobs = JobRepository(session)
    known = repo.known_sample_ids([s.sample_id for s in report.samples])
    stored = 0
    finished: list[int] = []
    seen: set[str] = set()
    for sample in report.samples:
        if sample.sample_id in known or sample.sample_id in seen:
            continue
        seen.add(sample.sample_id)
        job = jobs.get(sample.job_id, for_update=True)
        if job is None:
            continue  # a job deleted meanwhile: nothing to charge it to
        repo.add(
            TelemetryRow(
                sample_id=sample.sample_id,
                job_id=job.id,
                node_id=node.id if node else None,
                at=sample.at,
                interval_s=sample.interval_s,
                step=sample.step,
                samples_done=sample.samples_done,
                samples_per_s=sample.samples_per_s,
                loss=sample.loss,
                gpus=sample.gpus,
                layout=sample.layout,
                power_w=sample.power_w,
                energy_kwh=sample.energy_kwh,
                power_source=sample.power_source,
            )
        )
        stored += 1
        # Progress only moves forward, whatever order retried samples arrive in.
        job.samples_done = max(job.samples_done, sample.samples_done)
        job.step = max(job.step, sample.step)
        total = total_samples_of(job.total_samples, job.total_steps, job.global_batch_size)
        if (sample.finished or job.samples_done >= total) and JobState(
            job.state
        ) not in TERMINAL_STATES:
            jobs.add_event(
                transition(
                    job, JobState.SUCCEEDED, reason=f"all {total} samples done", at=sample.at
                )
            )
            job.current_gpus = 0
            NodeRepository(session).release_job(job.id)
            finished.append(job.id)
    session.flush()
    return IngestResult(stored, len(report.samples) - stored, finished)
