"""ElasticFlow-format job traces and their per-job throughput/power tables."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from energy_model.power import A100_POWER, GpuPowerSpec, job_power_w
from energy_model.profiles import ScalingProfile

TRACE_COLUMNS = (
    "job_id",
    "submission_time",
    "num_iteration",
    "model_name",
    "deadline",
    "batch_size",
    "num_gpu",
    "duration",
)


class TraceError(ValueError):
    """A trace file or row is malformed (the message names the file, line and field)."""


@dataclass(frozen=True)
class TraceJob:
    """One row of an ElasticFlow trace; times are seconds from trace time 0."""

    job_id: str
    submission_s: float
    num_iteration: int
    model_name: str
    deadline_s: float | None
    batch_size: int
    num_gpu: int
    duration_s: float

    @property
    def total_samples(self) -> float:
        """Work of the job in samples (iterations x global batch size)."""
        return float(self.num_iteration * self.batch_size)


def load_trace(path: Path, limit: int | None = None) -> list[TraceJob]:
    """Read `job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration`."""
    if limit is not None and limit < 1:
        raise TraceError(f"--limit must be at least 1, got {limit}")
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    jobs: list[TraceJob] = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing columns {', '.join(missing)}")
        for line_no, row in enumerate(reader, start=2):
            try:
                deadline_text = (row["deadline"] or "").strip()
                job = TraceJob(
                    job_id=row["job_id"].strip(),
                    submission_s=float(row["submission_time"]),
                    num_iteration=int(float(row["num_iteration"])),
                    model_name=row["model_name"].strip(),
                    deadline_s=float(deadline_text) if deadline_text else None,
                    batch_size=int(float(row["batch_size"])),
                    num_gpu=int(float(row["num_gpu"])),
                    duration_s=float(row["duration"]),
                )
            except (ValueError, KeyError, AttributeError) as exc:
                raise TraceError(f"{path}:{line_no}: {exc}") from exc
            if job.num_iteration <= 0 or job.batch_size <= 0:
                raise TraceError(f"{path}:{line_no}: num_iteration and batch_size must be > 0")
            jobs.append(job)
            if limit is not None and len(jobs) >= limit:
                break
    if not jobs:
        raise TraceError(f"{path}: the trace has no jobs")
    jobs.sort(key=lambda j: (j.submission_s, j.job_id))
    return jobs


@dataclass(frozen=True)
class JobTables:
    """Allowed GPU counts with throughput (samples/s) and total power (W) at each."""

    allowed_gpus: tuple[int, ...]
    throughput_samples_per_s: tuple[float, ...]
    power_w: tuple[float, ...]


def job_tables(
    job: TraceJob,
    profiles: dict[str, ScalingProfile],
    max_gpus: int,
    gpu: GpuPowerSpec = A100_POWER,
) -> JobTables:
    """Tables of one trace job from its model's scaling profile and the GPU power model."""
    profile = profiles.get(job.model_name)
    if profile is None:
        raise TraceError(
            f"job {job.job_id}: no scaling profile for model {job.model_name!r}; "
            f"profiles: {', '.join(sorted(profiles))}"
        )
    measured = profile.samples_per_s(job.batch_size)
    counts = sorted(g for g in measured if g <= max_gpus)
    if not counts:
        raise TraceError(f"job {job.job_id}: no measured GPU count fits a {max_gpus}-GPU cluster")
    single = measured.get(1, measured[counts[0]] / counts[0])
    allowed: list[int] = []
    throughput: list[float] = []
    power: list[float] = []
    for g in counts:
        rate = measured[g]
        # More GPUs for no more speed is never worth it: drop dominated counts.
        if throughput and rate <= throughput[-1] * (1 + 1e-9):
            continue
        if not math.isfinite(rate) or rate <= 0:
            continue
        allowed.append(g)
        throughput.append(rate)
        power.append(job_power_w(g, rate, single, gpu))
    return JobTables(tuple(allowed), tuple(throughput), tuple(power))


def deadlines_beyond_horizon(jobs: list[TraceJob], horizon_s: float) -> int:
    """Jobs whose deadline lies more than `horizon_s` after their submission."""
    # Admission plans only to the horizon and assumes full speed after it (optimistic where the
    # cluster is busy then); ElasticFlow plans to the deadline, so these jobs are where the two
    # simulators' admission can differ.
    return sum(
        1
        for j in jobs
        if j.deadline_s is not None and j.deadline_s - j.submission_s > horizon_s + 1e-9
    )
