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
# Other names ElasticFlow's traces use for the same fields (its `jobs.py` reads them all):
# `elasticVpollux_e.csv` has `submit_time, iteration, ddl`; `philly_103959.csv` has those plus
# `real_iteration, real_duration`, which ElasticFlow does not read (it prefers `iteration`).
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "submission_time": ("submission_time", "submit_time"),
    "num_iteration": ("iteration", "num_iteration"),
    "deadline": ("deadline", "ddl"),
}
# ElasticFlow writes sys.maxsize as the deadline of a best-effort job; any deadline this far
# off (over a century) means none.
NO_DEADLINE_S = 1e10


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
    # Admitted without a guarantee when admission cannot promise its deadline (the job only asks
    # to finish within its window), instead of being rejected.
    best_effort: bool = False

    @property
    def total_samples(self) -> float:
        """Work of the job in samples (iterations x global batch size)."""
        return float(self.num_iteration * self.batch_size)


def _columns(path: Path, header: list[str]) -> dict[str, str]:
    """Each field's column in this file (the first of its names the header has)."""
    found: dict[str, str] = {}
    missing: list[str] = []
    for field_name in TRACE_COLUMNS:
        names = COLUMN_ALIASES.get(field_name, (field_name,))
        column = next((n for n in names if n in header), None)
        if column is None:
            missing.append(" or ".join(names))
        else:
            found[field_name] = column
    if missing:
        raise TraceError(f"{path}: missing columns {', '.join(missing)}")
    return found


def load_trace(path: Path, limit: int | None = None) -> list[TraceJob]:
    """Read an ElasticFlow trace: `job_id, submission_time, num_iteration, model_name, deadline,
    batch_size, num_gpu, duration`, or the same fields under ElasticFlow's other names
    (`submit_time`, `iteration`, `ddl`: its `elasticVpollux_e.csv` and `philly_103959.csv`),
    with an optional `best_effort` column (1: no deadline)."""
    if limit is not None and limit < 1:
        raise TraceError(f"--limit must be at least 1, got {limit}")
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    jobs: list[TraceJob] = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        col = _columns(path, list(reader.fieldnames or []))
        for line_no, row in enumerate(reader, start=2):
            try:
                deadline_text = (row[col["deadline"]] or "").strip()
                deadline = float(deadline_text) if deadline_text else None
                if deadline is not None and deadline >= NO_DEADLINE_S:
                    deadline = None
                if (row.get("best_effort") or "0").strip() not in ("", "0"):
                    deadline = None
                job = TraceJob(
                    job_id=row[col["job_id"]].strip(),
                    submission_s=float(row[col["submission_time"]]),
                    num_iteration=int(float(row[col["num_iteration"]])),
                    model_name=row[col["model_name"]].strip(),
                    deadline_s=deadline,
                    batch_size=int(float(row[col["batch_size"]])),
                    num_gpu=int(float(row[col["num_gpu"]])),
                    duration_s=float(row[col["duration"]]),
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
    # Plans reach only to the horizon and let each job run alone at full speed after it;
    # admission checks only that the work left there fits the cluster's GPU-seconds
    # (optimistic where the cluster is busy then); ElasticFlow plans to the deadline, so these jobs are where the two
    # simulators' admission can differ.
    return sum(
        1
        for j in jobs
        if j.deadline_s is not None and j.deadline_s - j.submission_s > horizon_s + 1e-9
    )
