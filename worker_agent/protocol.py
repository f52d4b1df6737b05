"""The wire schema between the scheduler and worker agents (imported by both sides).

Agent -> scheduler (the node's own credential, an agent token named after the node):
register, heartbeat, telemetry.
Scheduler -> agent (the per-node secret the scheduler hands out at each registration): apply
an allocation, stop a job, report status.

Every number is bounded (integers to the database's column types, floats finite) and every
string bounded and printable, so no value an agent sends can fail below the API.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
)

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
MODULE_PRESETS: frozenset[str] = frozenset({"gpt2", "bert", "resnet50"})
"""Presets that run as nn.Module jobs (worker_agent/workloads.py PRESET_MODEL): exported when
they finish, and may start from exported weights (`init_from`), like entrypoint jobs."""

ENTRYPOINT_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
WORKLOAD_PATTERN = (
    "^("
    + "|".join(p.replace("-", r"\-") for p in WORKLOAD_PRESETS)
    + "|"
    + ENTRYPOINT_PATTERN
    + ")$"
)

# A workdir bundle's name: the SHA-256 of its bytes, lower-case hex.
SHA256_PATTERN = r"^[0-9a-f]{64}$"

# Header carrying the per-node secret on scheduler -> agent calls.
AGENT_SECRET_HEADER = "X-GreenFlow-Agent-Secret"

PowerSource = Literal["nvml", "estimated"]
# Where a node power reading came from: NVML per GPU, a DCGM exporter's Prometheus endpoint,
# RAPL (CPU packages), or the configured node model (an estimate).
NodePowerSource = Literal["nvml", "dcgm", "rapl", "estimated"]
NodeName = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")]

# Bounds of the database columns the values end up in (BIGINT, INTEGER).
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_SLOTS = 1024
BigCount = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
JobId = Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
Generation = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
SlotCount = Annotated[int, Field(strict=True, ge=0, le=MAX_SLOTS)]
SlotIndex = Annotated[int, Field(strict=True, ge=0, le=MAX_SLOTS)]
Pid = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
# A host name or an IPv4/IPv6 address other nodes connect to.
HostAddress = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:_-]+$")]
Port = Annotated[int, Field(strict=True, ge=1, le=65535)]


def _finite(low: float, high: float) -> Any:
    return Field(strict=True, ge=low, le=high, allow_inf_nan=False)


# Printable ASCII (no control characters, so no NUL): ids and labels the database stores.
def _printable(max_length: int, min_length: int = 0) -> Any:
    return Field(min_length=min_length, max_length=max_length, pattern=r"^[\x20-\x7e]*$")


def _iso_text(value: Any) -> Any:
    # Numbers would be read as Unix times; the schema promises an ISO 8601 string.
    if not isinstance(value, str | datetime):
        raise ValueError("must be an ISO 8601 date-time string with a time zone")
    return value


def _plausible_year(value: datetime) -> datetime:
    # Far dates overflow date arithmetic once shifted to UTC; no measurement is that old or new.
    if not 2000 <= value.year <= 9000:
        raise ValueError("must be between the years 2000 and 9000")
    return value.astimezone(UTC)


def _finite_or_none(value: Any) -> Any:
    # A diverged run's loss is NaN or infinite: recorded as unknown, never as a number.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


WireDatetime = Annotated[AwareDatetime, BeforeValidator(_iso_text), AfterValidator(_plausible_year)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuSlotInfo(_Wire):
    """One GPU (or simulated slot) an agent offers."""

    index: SlotIndex
    uuid: Annotated[str, _printable(100)] | None = None
    memory_mb: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] = 0


class NodeRegistration(_Wire):
    """What an agent tells the scheduler when it starts (or comes back)."""

    name: NodeName
    agent_url: Annotated[
        str, Field(min_length=1, max_length=500, pattern=r"^https?://[\x21-\x7e]+$")
    ]
    gpu_kind: Annotated[str, _printable(64)] = "simulated"
    simulated: StrictBool = True
    slots: Annotated[list[GpuSlotInfo], Field(min_length=1, max_length=MAX_SLOTS)]
    # The address other nodes reach this node on (never loopback when the node has another
    # interface): a job whose runner is here hosts its rendezvous store there, and this node's
    # worker host (started workers of jobs whose runner is on another node) listens there on
    # `worker_host_port`. None: this agent runs jobs inside its node only.
    rendezvous_host: HostAddress | None = None
    worker_host_port: Port | None = None


class NodeRegistered(_Wire):
    """The scheduler's answer to a registration."""

    node_id: int
    heartbeat_interval_s: float
    telemetry_interval_s: float
    # What the scheduler presents (AGENT_SECRET_HEADER) on its calls to this agent from now on;
    # new at every registration.
    agent_secret: str
    # The node model the agent estimates with where nothing measures: watts of one idle GPU
    # and of the host (CPUs, memory, fans) without RAPL.
    idle_power_per_gpu_w: float = 0.0
    host_power_w: float = 0.0


class RunningJob(_Wire):
    """A job as the agent currently runs it."""

    job_id: JobId
    generation: Generation
    gpus: SlotCount
    slot_indices: Annotated[list[SlotIndex], Field(max_length=MAX_SLOTS)]
    layout: Annotated[str, _printable(200)] | None
    step: BigCount
    samples_done: BigCount
    worker_pids: Annotated[list[Pid], Field(max_length=MAX_SLOTS)]
    finished: StrictBool = False
    error: str | None = None
    # The job's own code failed (job module import, job function, its return value): it cannot
    # run anywhere, so the scheduler fails it instead of placing it again.
    job_error: StrictBool = False
    # Nodes whose workers of this job were lost and that the job now runs without, on this
    # node's slots alone, from the survivors' replicas (until the next command it applies).
    lost_nodes: Annotated[list[NodeName], Field(max_length=MAX_SLOTS)] = []


class Heartbeat(_Wire):
    """Periodic liveness report with the agent's view of its jobs."""

    jobs: Annotated[list[RunningJob], Field(max_length=4096)] = []


class HeartbeatAck(_Wire):
    """The scheduler's answer: jobs the agent runs that the scheduler no longer wants."""

    stop_job_ids: list[int] = []


class TelemetrySample(_Wire):
    """What an agent measured for one job over one interval.

    The schema bounds each value; the scheduler further checks the sample against the job's
    placement (node and generation) and physics (the node's GPUs at most at full power)."""

    sample_id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    job_id: JobId
    generation: Generation
    at: WireDatetime
    interval_s: Annotated[float, Field(strict=True, gt=0, le=86_400, allow_inf_nan=False)]
    step: BigCount
    samples_done: BigCount
    samples_per_s: Annotated[float, _finite(0, 1e12)]
    loss: Annotated[
        Annotated[float, _finite(-1e30, 1e30)] | None, BeforeValidator(_finite_or_none)
    ] = None
    gpus: SlotCount
    layout: Annotated[str, _printable(32)] | None = None
    power_w: Annotated[float, _finite(0, 1e7)]
    energy_kwh: Annotated[float, _finite(0, 1e4)]
    power_source: PowerSource
    finished: StrictBool = False


class PowerReading(_Wire):
    """Energy of one GPU or of the host (or one CPU package) over a node power interval."""

    component: Literal["gpu", "host"]
    # GPU slot index, or the host part ("host", "package-0", ...).
    device: Annotated[str, _printable(32, min_length=1)]
    # The job holding the GPU at the end of the interval; None for an idle GPU and the host.
    job_id: JobId | None = None
    energy_j: Annotated[float, _finite(0, 1e10)]
    source: NodePowerSource


class NodePowerSample(_Wire):
    """Everything a node drew over one interval: every GPU (busy or idle) and the host."""

    sample_id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    at: WireDatetime
    interval_s: Annotated[float, Field(strict=True, gt=0, le=86_400, allow_inf_nan=False)]
    readings: Annotated[list[PowerReading], Field(max_length=2 * MAX_SLOTS + 64)]


class TelemetryReport(_Wire):
    """A batch of telemetry samples (retries are safe: sample_id makes them idempotent)."""

    samples: Annotated[list[TelemetrySample], Field(max_length=1000)]
    node_power: Annotated[list[NodePowerSample], Field(max_length=1000)] = []
    # The reporting node: must be the node whose credential sends the report (or omitted).
    node: NodeName | None = None


class TelemetryAck(_Wire):
    """How many samples were new, how many repeats, and how many the scheduler refused."""

    stored: int
    duplicates: int
    # Samples that do not belong to this node's jobs and generations, or exceed what its GPUs
    # can do; they are counted and logged by the scheduler, never charged. Not worth a retry.
    rejected: int = 0
    # Node power samples: stored, and refused (beyond the node's GPUs, overlapping, in the future).
    node_power_stored: int = 0
    node_power_rejected: int = 0


class WorkloadSpec(_Wire):
    """What the agent needs to build and run a job."""

    workload: str
    global_batch_size: int
    total_samples: int
    seed: int = 0
    # A user job module's code: the agent fetches the bundle (GET /v1/bundles/{sha256}) and
    # imports the entrypoint from it; options are the job function's keyword arguments.
    bundle_sha256: Annotated[str, Field(pattern=SHA256_PATTERN)] | None = None
    options: dict[str, Any] = {}
    # When the job was submitted: with the id, what tells this job's checkpoints apart from
    # those of a job with the same id and workload under another scheduler database.
    job_created_at: datetime | None = None
    # Module jobs: start from these weights (step 0, fresh optimizer) instead of the model's
    # own initialisation: "job:<id>" (that job's export in the agent's export directory) or an
    # absolute path on the node (an exported or Hugging Face directory, or a .safetensors file).
    init_from: Annotated[str, Field(max_length=1000)] | None = None


class RemotePart(_Wire):
    """A job's GPU slots on another node, whose worker host starts their workers."""

    node: NodeName
    host: HostAddress
    port: Port
    slot_indices: Annotated[list[SlotIndex], Field(min_length=1, max_length=MAX_SLOTS)]
    # worker_grant(that node's secret, this job, the runner's node): what the runner presents
    # to that node's worker host, and that node's workers back to the runner.
    grant: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class AllocationCommand(_Wire):
    """Run `job_id` on these slots (0 slots = pause it, keeping its state in memory).

    `slot_indices` are this node's slots; `remote` the job's slots on further nodes (a job
    across nodes: this node runs the job's runner and hosts its rendezvous store)."""

    job_id: Annotated[int, Field(ge=1)]
    generation: Annotated[int, Field(ge=1)]
    slot_indices: list[Annotated[int, Field(ge=0)]]
    remote: Annotated[list[RemotePart], Field(max_length=256)] = []
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
    # snapshot) or "checkpoint@step<N>" (shared storage); None for a hot switch or a command
    # that found the job already running on exactly its slots.
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


MAX_LOG_CHUNK_BYTES = 256 << 10
"""Most output one logs request returns."""


class JobLogChunk(_Wire):
    """A piece of one job worker's captured output (or its `greenflow_log` scalars, as JSON
    lines), by the rank the worker holds in the job's newest layout."""

    job_id: int
    rank: int
    worker: int | None = None
    """The worker process (`worker-<id>.log` on the agent); None: no output for that rank yet."""
    stream: Literal["output", "scalars"] = "output"
    offset: int
    """Where `text` starts (bytes since the worker's output began)."""
    next_offset: int
    """Where the next read continues."""
    skipped_bytes: int = 0
    """Output between the requested offset and `offset` that the agent's size cap dropped."""
    text: str = ""
    node: str | None = None
    """The node whose agent holds the output (set by the scheduler)."""


MAX_CURVE_POINTS = 5000
"""Most steps one scalar curve returns."""


class JobScalarCurve(_Wire):
    """A job's `greenflow_log` scalars per step: each name's mean over the lines of that step
    (every rank and micro-batch), across hot switches; what the console plots."""

    job_id: int
    steps: list[int] = []
    series: dict[str, list[float | None]] = {}
    """Name -> one value per entry of `steps` (None: not logged at that step)."""
    lines: int = 0
    """Scalar lines read (before thinning to at most the points asked for)."""
    node: str | None = None
    """The node whose agent holds the scalars (set by the scheduler)."""


def worker_grant(node_secret: str, job_id: int, runner_node: str) -> str:
    """The key a job's runner on `runner_node` and the worker host of the node whose secret is
    `node_secret` share for that job: the scheduler derives it for the runner, the host again.

    Scoped to one job, one runner node and one registration of the host's node (its secret is
    new at each), so a node's credential opens no other node's worker host beyond the parts
    the scheduler gave its jobs, and a node that registers again voids every grant to it.
    """
    message = f"greenflow-worker-grant\x00{job_id}\x00{runner_node}".encode()
    return hmac.new(node_secret.encode(), message, hashlib.sha256).hexdigest()
