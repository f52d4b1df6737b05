"""Telemetry ingestion: check each sample against placement and physics, store it once, advance
job progress, finish done jobs.

A node speaks only for the jobs placed on it. A sample counts when the job's allocation of
the sample's generation was sent to the reporting node, the sample's interval lies between
that command and the acknowledgement of the next one (plus a grace), it does not overlap the
node's previous sample of the job, and its energy, power and progress are within what the
node's GPUs can do. Anything else is rejected: counted, logged once, never stored, so never
charged to the ledger.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from sqlalchemy.orm import Session

from energy_model.emissions import J_PER_KWH
from energy_model.job_model import GENERIC_WORKLOAD, prior_params, resolve_workload
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import (
    Allocation,
    Job,
    Node,
    NodePowerReading,
    NodePowerSampleRow,
)
from scheduler_service.db.models import TelemetrySample as TelemetryRow
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.exceptions import NotAllowed, UnknownNode
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import TERMINAL_STATES, JobState, transition
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.telemetry.repository import NodePowerRepository, TelemetryRepository
from worker_agent.protocol import NodePowerSample, TelemetryReport, TelemetrySample

log = logging.getLogger(__name__)

# Agents' clocks may drift this far from the scheduler's.
CLOCK_SKEW_S = 120.0
# Relative slack on the physical bounds (float rounding of the agent's own arithmetic).
BOUND_SLACK = 1e-6


class Rejection(StrEnum):
    """Why a sample was refused (the `reason` label of the rejection metric)."""

    UNKNOWN_JOB = "unknown_job"
    NOT_PLACED_HERE = "not_placed_here"
    SUPERSEDED = "superseded_generation"
    OUT_OF_TIME = "outside_allocation_time"
    OVERLAPS = "overlaps_previous_sample"
    TOO_MANY_GPUS = "more_gpus_than_node"
    TOO_MUCH_POWER = "power_above_node_maximum"
    TOO_MUCH_ENERGY = "energy_above_node_maximum"
    TOO_FAST = "progress_above_model"


class NodePowerRejection(StrEnum):
    """Why a node power sample was refused (the `reason` label of the rejection metric)."""

    IN_FUTURE = "node_power_in_future"
    OVERLAPS = "node_power_overlaps_previous"
    UNKNOWN_GPU = "node_power_unknown_gpu"
    TOO_MUCH_ENERGY = "node_power_above_node_maximum"
    NOT_PLACED_HERE = "node_power_job_not_placed_here"


@dataclass(frozen=True)
class TelemetryLimits:
    """The physical bounds a sample is checked against."""

    max_power_per_gpu_w: float
    rate_factor: float
    # How long after the next generation's acknowledgement a sample of the previous one may
    # still end (its last interval is reported after the switch).
    grace_s: float


@dataclass(frozen=True)
class IngestResult:
    """How many samples were new, repeats and refused, and which jobs finished."""

    stored: int
    duplicates: int
    rejected: dict[Rejection, list[int]]
    finished_job_ids: list[int]
    node_power_stored: int = 0
    # Refused node power samples by reason.
    node_power_rejected: dict[NodePowerRejection, int] = field(default_factory=dict)

    @property
    def rejected_count(self) -> int:
        """Refused samples, all reasons together."""
        return sum(len(ids) for ids in self.rejected.values())


@dataclass
class RejectionLog:
    """Logs each (node, job, reason) once, however often a node repeats it (bounded memory)."""

    max_keys: int = 10_000
    _seen: OrderedDict[tuple[str, int, str], None] = field(default_factory=OrderedDict)

    def note(self, node: str, result: IngestResult) -> None:
        """Log the rejections of one report not logged before."""
        for reason, job_ids in result.rejected.items():
            for job_id, count in Counter(job_ids).items():
                key = (node, job_id, reason.value)
                if key in self._seen:
                    continue
                self._seen[key] = None
                if len(self._seen) > self.max_keys:
                    self._seen.popitem(last=False)
                log.warning(
                    "telemetry from node %s for job %d refused (%s, %d sample(s)); "
                    "further refusals of this kind are only counted",
                    node,
                    job_id,
                    reason.value,
                    count,
                )


def total_samples_of(
    total_samples: int | None, total_steps: int | None, global_batch_size: int
) -> int:
    """A job's work in samples, whichever way its spec gave it."""
    if total_samples is not None:
        return total_samples
    return (total_steps or 0) * global_batch_size


@dataclass
class _JobContext:
    job: Job
    allocations: dict[int, Allocation]
    last_at: datetime | None  # end of this node's newest stored sample of the job


def _superseded_at(ctx: _JobContext, generation: int) -> datetime | None:
    """When a later command of the job was acknowledged (the end of this generation's time)."""
    later = [
        a.acked_at
        for g, a in ctx.allocations.items()
        if g > generation and a.status == "acked" and a.acked_at is not None
    ]
    return min(later) if later else None


def _max_samples_per_s(job: Job, gpus: int, factor: float) -> float | None:
    """`factor` times the job's prior throughput at `gpus`; None where no measured prior exists."""
    if resolve_workload(job.workload) == GENERIC_WORKLOAD or gpus <= 0:
        return None
    params = prior_params(job.workload, job.global_batch_size)
    return factor * params.throughput.samples_per_s(gpus, job.global_batch_size)


def _check(
    sample: TelemetrySample,
    ctx: _JobContext,
    node: Node,
    limits: TelemetryLimits,
    now: datetime,
) -> Rejection | None:
    allocation = ctx.allocations.get(sample.generation)
    if (
        allocation is None
        or allocation.node_id != node.id
        or allocation.sent_at is None
        or allocation.status == "rejected"
    ):
        return Rejection.NOT_PLACED_HERE
    start = sample.at - timedelta(seconds=sample.interval_s)
    skew = timedelta(seconds=CLOCK_SKEW_S)
    if sample.at > now + skew or start < allocation.created_at - skew:
        return Rejection.OUT_OF_TIME
    superseded = _superseded_at(ctx, sample.generation)
    if superseded is not None and start > superseded + timedelta(seconds=limits.grace_s):
        return Rejection.SUPERSEDED
    if ctx.last_at is not None and start < ctx.last_at - skew / 60:
        return Rejection.OVERLAPS
    # A job across nodes reports from its runner's node (the allocation's node), for all its
    # GPUs: this node's and those of its parts on further nodes.
    slots = len(node.slots) + sum(len(indices) for _, indices in allocation.parts or [])
    if sample.gpus > slots:
        return Rejection.TOO_MANY_GPUS
    max_power_w = slots * limits.max_power_per_gpu_w * (1 + BOUND_SLACK)
    if sample.power_w > max_power_w:
        return Rejection.TOO_MUCH_POWER
    if sample.energy_kwh > max_power_w * sample.interval_s / J_PER_KWH:
        return Rejection.TOO_MUCH_ENERGY
    rate = _max_samples_per_s(ctx.job, max(sample.gpus, 1), limits.rate_factor)
    if rate is not None:
        # Two steps of slack: a short interval that completed a step shows a high rate.
        allowance = rate * sample.interval_s + 2 * ctx.job.global_batch_size
        claimed = sample.samples_per_s * sample.interval_s
        progress = sample.samples_done - ctx.job.samples_done
        if claimed > allowance or progress > allowance:
            return Rejection.TOO_FAST
    return None


def ingest(
    session: Session, node_name: str, report: TelemetryReport, limits: TelemetryLimits
) -> IngestResult:
    """Store the node's new, valid samples (retries are no-ops), move progress forward, mark
    finished jobs; refuse samples of jobs not placed on this node or beyond its GPUs."""
    if report.node is not None and report.node != node_name:
        raise NotAllowed(
            f"this agent token is the credential of node {node_name!r}; it cannot report for "
            f"node {report.node!r}"
        )
    node = NodeRepository(session).by_name(node_name)
    if node is None or node.state == "lost":
        raise UnknownNode(node_name)
    repo = TelemetryRepository(session)
    jobs = JobRepository(session)
    allocations = AllocationRepository(session)
    # Lock the batch's jobs first (in id order: concurrent batches cannot deadlock), then look
    # for repeats: a re-sent batch that waited on those locks sees what the first one stored.
    locked = jobs.get_many(sorted({s.job_id for s in report.samples}), for_update=True)
    known = repo.known_sample_ids([s.sample_id for s in report.samples])
    now = utcnow()
    stored = 0
    duplicates = 0
    rejected: dict[Rejection, list[int]] = {}
    finished: list[int] = []
    seen: set[str] = set()
    contexts: dict[int, _JobContext | None] = {}
    oldest_generation: dict[int, int] = {}
    for sample in report.samples:
        oldest_generation[sample.job_id] = min(
            sample.generation, oldest_generation.get(sample.job_id, sample.generation)
        )
    for sample in report.samples:
        if sample.sample_id in known or sample.sample_id in seen:
            duplicates += 1
            continue
        seen.add(sample.sample_id)
        if sample.job_id not in contexts:
            job = locked.get(sample.job_id)
            contexts[sample.job_id] = (
                None
                if job is None
                else _JobContext(
                    job,
                    allocations.by_generation(job.id, since=oldest_generation[job.id]),
                    repo.last_end_from(job.id, node.id),
                )
            )
        ctx = contexts[sample.job_id]
        reason = Rejection.UNKNOWN_JOB if ctx is None else _check(sample, ctx, node, limits, now)
        if reason is not None or ctx is None:
            rejected.setdefault(reason or Rejection.UNKNOWN_JOB, []).append(sample.job_id)
            continue
        job = ctx.job
        repo.add(
            TelemetryRow(
                sample_id=sample.sample_id,
                job_id=job.id,
                node_id=node.id,
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
        ctx.last_at = max(ctx.last_at, sample.at) if ctx.last_at is not None else sample.at
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
    power_stored, power_duplicates, power_rejected = _ingest_node_power(
        session, node, report.node_power, limits, now
    )
    session.flush()
    return IngestResult(
        stored,
        duplicates + power_duplicates,
        rejected,
        finished,
        node_power_stored=power_stored,
        node_power_rejected=power_rejected,
    )


def _check_node_power(
    sample: NodePowerSample,
    node: Node,
    last_at: datetime | None,
    placed: set[int],
    limits: TelemetryLimits,
    now: datetime,
) -> NodePowerRejection | None:
    start = sample.at - timedelta(seconds=sample.interval_s)
    skew = timedelta(seconds=CLOCK_SKEW_S)
    if sample.at > now + skew:
        return NodePowerRejection.IN_FUTURE
    if last_at is not None and start < last_at - skew / 60:
        return NodePowerRejection.OVERLAPS
    slots = len(node.slots)
    gpu_max_j = limits.max_power_per_gpu_w * sample.interval_s * (1 + BOUND_SLACK)
    devices: set[str] = set()
    host_j = 0.0
    for reading in sample.readings:
        if reading.component == "host":
            host_j += reading.energy_j
            continue
        if (
            not reading.device.isdigit()
            or int(reading.device) >= slots
            or reading.device in devices
        ):
            return NodePowerRejection.UNKNOWN_GPU
        devices.add(reading.device)
        if reading.energy_j > gpu_max_j:
            return NodePowerRejection.TOO_MUCH_ENERGY
        if reading.job_id is not None and reading.job_id not in placed:
            return NodePowerRejection.NOT_PLACED_HERE
    # The host may draw at most what the per-GPU bound allows for the node's GPUs together.
    if host_j > gpu_max_j * max(slots, 1):
        return NodePowerRejection.TOO_MUCH_ENERGY
    return None


def _ingest_node_power(
    session: Session,
    node: Node,
    samples: list[NodePowerSample],
    limits: TelemetryLimits,
    now: datetime,
) -> tuple[int, int, dict[NodePowerRejection, int]]:
    """Store the node's new, valid power samples: (stored, duplicates, refused by reason).

    A reading may name only a job allocated to this node (a node cannot push its idle and host
    energy onto other nodes' jobs); its energy is bounded like job telemetry's."""
    if not samples:
        return 0, 0, {}
    repo = NodePowerRepository(session)
    known = repo.known_sample_ids([s.sample_id for s in samples])
    named = {r.job_id for s in samples for r in s.readings if r.job_id is not None}
    placed = repo.placed_job_ids(node.id, named)
    last_at = repo.last_end(node.id)
    stored = duplicates = 0
    rejected: dict[NodePowerRejection, int] = {}
    for sample in sorted(samples, key=lambda s: s.at):
        if sample.sample_id in known:
            duplicates += 1
            continue
        known.add(sample.sample_id)
        reason = _check_node_power(sample, node, last_at, placed, limits, now)
        if reason is not None:
            rejected[reason] = rejected.get(reason, 0) + 1
            continue
        repo.add(
            NodePowerSampleRow(
                sample_id=sample.sample_id,
                node_id=node.id,
                at=sample.at,
                interval_s=sample.interval_s,
                readings=[
                    NodePowerReading(
                        component=r.component,
                        device=r.device,
                        job_id=r.job_id,
                        energy_j=r.energy_j,
                        source=r.source,
                    )
                    for r in sample.readings
                ],
            )
        )
        stored += 1
        last_at = sample.at if last_at is None else max(last_at, sample.at)
    return stored, duplicates, rejected
