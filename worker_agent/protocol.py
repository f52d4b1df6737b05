"""The wire schema between the scheduler and worker agents (imported by both sides).

Agent -> scheduler (agent token): register, heartbeat, telemetry.
Scheduler -> agent (per-node secret the agent chose at registration): apply an allocation,
stop a job, report status.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

# Workload presets a job spec may name; anything else must be a `module:function` entrypoint.
# gpt2/bert/mlp (and their -tiny variants) run on the built-in runtime presets; the others are
# the models of the public scaling profiles and run as stand-ins sized like them.
WORKLOAD_PRESETS: tuple[str, ...] = (
    "gpt2",
    "gpt-tiny",
    "bert",
    "bert-tiny",
    "mlp",
    "resnet50",
    "vgg16",
    "inception3",
    "deepspeech2",
)

ENTRYPOINT_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
WORKLOAD_PATTERN = (
    "^("
    + "|".join(p.replace("-", r"\-") for p in WORKLOAD_PRESETS)
    + "|"
    + ENTRYPOINT_PATTERN
    + ")$"
)

# Header carrying the per-node secret on scheduler -> agent calls.
AGENT_SECRET_HEADER = "X-GreenFlow-Agent-Secret"

PowerSource = Literal["nvml", "estimated"]
NodeName = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuSlotInfo(_Wire):
    """One GPU (or simulated slot) an agent offers."""

    index: Annotated[int, Field(ge=0, le=1024)]
    uuid: str | None = None
    memory_mb: Annotated[int, Field(ge=0)] = 0


class NodeRegistration(_Wire):
    """What an agent tells the scheduler when it starts (or comes back)."""

    name: NodeName
    agent_url: Annotated[str, Field(min_length=1, max_length=500, pattern=r"^https?://")]
    agent_secret: Annotated[str, Field(min_length=16, max_length=200)]
    gpu_kind: Annotated[str, Field(max_length=64)] = "simulated"
    simulated: bool = True
    slots: Annotated[list[GpuSlotInfo], Field(min_length=1, max_length=1024)]


class NodeRegistered(_Wire):
    """The scheduler's answer to a registration."""

    node_id: int
    heartbeat_interval_s: float
    telemetry_interval_s: float


class RunningJob(_Wire):
    """A job as the agent currently runs it."""

    job_id: int
    generation: int
    gpus: int
    slot_indices: list[int]
    layout: str | None
    step: int
    samples_done: int
    worker_pids: list[int]
    finished: bool = False
    error: str | None = None


class Heartbeat(_Wire):
    """Periodic liveness report with the agent's view of its jobs."""

    jobs: list[RunningJob] = []


class HeartbeatAck(_Wire):
    """The scheduler's answer: jobs the agent runs that the scheduler no longer wants."""

    stop_job_ids: list[int] = []


class TelemetrySample(_Wire):
    """What an agent measured for one job over one interval."""

    sample_id: Annotated[str, Field(min_length=1, max_length=64)]
    job_id: Annotated[int, Field(ge=1)]
    generation: Annotated[int, Field(ge=0)]
    at: AwareDatetime
    interval_s: Annotated[float, Field(gt=0, le=86_400)]
    step: Annotated[int, Field(ge=0)]
    samples_done: Annotated[int, Field(ge=0)]
    samples_per_s: Annotated[float, Field(ge=0)]
    loss: float | None = None
    gpus: Annotated[int, Field(ge=0)]
    layout: str | None = None
    power_w: Annotated[float, Field(ge=0)]
    energy_kwh: Annotated[float, Field(ge=0)]
    power_source: PowerSource
    finished: bool = False


class TelemetryReport(_Wire):
    """A batch of telemetry samples (retries are safe: sample_id makes them idempotent)."""

    samples: Annotated[list[TelemetrySample], Field(max_length=1000)]
    # The reporting node (its registered name); samples of unknown nodes are kept without one.
    node: NodeName | None = None


class TelemetryAck(_Wire):
    """How many samples were new and how many were repeats."""

    stored: int
    duplicates: int


class WorkloadSpec(_Wire):
    """What the agent needs to build and run a job."""

    workload: str
    global_batch_size: int
    total_samples: int
    seed: int = 0


class AllocationCommand(_Wire):
    """Run `job_id` on these slots (0 slots = pause it, keeping its state in memory)."""

    job_id: Annotated[int, Field(ge=1)]
    generation: Annotated[int, Field(ge=1)]
    slot_indices: list[Annotated[int, Field(ge=0)]]
    spec: WorkloadSpec
    # Power model of the job for simulated slots: total watts at each GPU count.
    estimated_power_w: dict[int, float] = {}
    issued_at: datetime


class AllocationAck(_Wire):
    """The agent applied (or had already applied) a command."""

    job_id: int
    generation: int
    gpus: int
    layout: str | None
    step: int
    worker_pids: list[int]
    hot_switch: bool = False
    switch_s: float | None = None
    bytes_moved: int | None = None
    # Where a (re)started run's state came from: "start" (step 0), "memory" (the pause
    # snapshot) or "checkpoint@step<N>" (shared storage); None for a hot switch.
    resumed_from: str | None = None


class StopCommand(_Wire):
    """Stop a job for good and free its slots."""

    job_id: Annotated[int, Field(ge=1)]
    generation: Annotated[int, Field(ge=1)]
    reason: str = ""


class AgentStatus(_Wire):
    """Everything the agent runs."""

    name: str
    jobs: list[RunningJob]
