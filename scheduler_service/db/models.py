"""ORM models: every persistent fact of the scheduler lives in one of these tables."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from scheduler_service.db.base import Base, utcnow

# BIGINT on PostgreSQL, INTEGER (the rowid alias, so autoincrement works) on SQLite.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class ApiToken(Base):
    """A bearer token; only the SHA-256 of its secret part is stored.

    The name is the identity: a user token's name owns jobs, an agent token's name is the one
    node it speaks for (its node credential). At most one unrevoked token per role and name.
    """

    __tablename__ = "api_tokens"
    __table_args__ = (
        Index(
            "uq_api_tokens_role_name_active",
            "role",
            "name",
            unique=True,
            sqlite_where=text("revoked_at IS NULL"),
            postgresql_where=text("revoked_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    token_id: Mapped[str] = mapped_column(String(32), unique=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(100), index=True)
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]


class ConsoleSession(Base):
    """A console sign-in: the cookie holds the session id, only its SHA-256 is stored here."""

    __tablename__ = "console_sessions"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    session_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    # The API token signed in with: the session ends when that token is revoked or expires.
    token_id: Mapped[str] = mapped_column(String(32), index=True)
    # The per-session form token every state-changing console form carries (against CSRF).
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]


class Job(Base):
    """A submitted training job: its spec, state and progress."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("owner", "submission_id"),
        Index("ix_jobs_state_created", "state", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    owner: Mapped[str] = mapped_column(String(100), index=True)
    submission_id: Mapped[str | None] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(200))
    workload: Mapped[str] = mapped_column(String(200))
    global_batch_size: Mapped[int]
    total_samples: Mapped[int | None] = mapped_column(BigInteger)
    total_steps: Mapped[int | None] = mapped_column(BigInteger)
    min_gpus: Mapped[int]
    max_gpus: Mapped[int]
    # Indexed: the console's deadline views and the planner select jobs by deadline.
    deadline_at: Mapped[datetime | None] = mapped_column(index=True)
    begin_after: Mapped[datetime | None]
    priority: Mapped[int] = mapped_column(default=1)
    queue: Mapped[str] = mapped_column(String(64), default="default")
    best_effort: Mapped[bool] = mapped_column(default=False)
    run_past_deadline: Mapped[bool] = mapped_column(default=False)
    held: Mapped[bool] = mapped_column(default=False)
    state: Mapped[str] = mapped_column(String(24), index=True)
    state_reason: Mapped[str] = mapped_column(Text, default="")
    samples_done: Mapped[int] = mapped_column(BigInteger, default=0)
    step: Mapped[int] = mapped_column(BigInteger, default=0)
    current_gpus: Mapped[int] = mapped_column(default=0)
    current_layout: Mapped[str | None] = mapped_column(String(32))
    # A user job module's code (workdir bundle, by SHA-256) and the job function's arguments.
    bundle_sha256: Mapped[str | None] = mapped_column(ForeignKey("bundles.sha256"), index=True)
    # Module jobs: the weights the run starts from ("job:<id>" or an absolute path on the node).
    init_from: Mapped[str | None] = mapped_column(String(1000))
    options: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    # Optimistic concurrency: the control loop and the API both change jobs; an update made
    # from a stale read fails (StaleDataError) instead of silently overwriting a newer state.
    version: Mapped[int] = mapped_column(default=1, server_default="1")

    events: Mapped[list[JobEvent]] = relationship(
        back_populates="job", lazy="raise", order_by="JobEvent.id"
    )

    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012


class Bundle(Base):
    """A job's code directory as uploaded (a .tar.gz named by its SHA-256); never unpacked here."""

    __tablename__ = "bundles"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(100))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Uploaded again or named by a new job; the retention sweep counts from the newest of this
    # and the finish of the last job that used it.
    last_used_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    # When the retention sweep removed the bytes (`data` is then empty); the row stays, so the
    # jobs that used it still name it. Uploading the same bytes again restores it.
    removed_at: Mapped[datetime | None] = mapped_column()


class JobEvent(Base):
    """One thing that happened to a job: a state change, an allocation change, a hot switch."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    # Indexed: the console's newest-events feed orders all events by time.
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(String(24), default="state")
    from_state: Mapped[str | None] = mapped_column(String(24))
    to_state: Mapped[str | None] = mapped_column(String(24))
    reason: Mapped[str] = mapped_column(Text, default="")
    actor: Mapped[str] = mapped_column(String(100), default="system")
    details: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    job: Mapped[Job] = relationship(back_populates="events", lazy="raise")


class Node(Base):
    """A worker node with its agent."""

    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    agent_url: Mapped[str] = mapped_column(String(500))
    state: Mapped[str] = mapped_column(String(16), default="ready")
    gpu_kind: Mapped[str] = mapped_column(String(64), default="simulated")
    simulated: Mapped[bool] = mapped_column(default=True)
    # The scheduler's secret toward this node's agent is derived from the scheduler's key, the
    # node and this nonce (new at every registration); the secret itself is never stored.
    agent_secret_nonce: Mapped[str] = mapped_column(String(64), default="", server_default="")
    # Which scheduler key the secret was derived with (a node registered under another key must
    # register again).
    secret_key_id: Mapped[str] = mapped_column(String(16), default="", server_default="")
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[datetime | None]
    # The address other nodes reach this node on (its jobs' rendezvous store, its worker host)
    # and the worker host's port; None: the agent runs jobs inside this node only.
    rendezvous_host: Mapped[str | None] = mapped_column(String(253))
    worker_host_port: Mapped[int | None]
    # When a job's runner on another node last reported this node's workers lost (None: never
    # since it registered): no job spans onto it until it is heard from again for three
    # heartbeat intervals after that (`planning.spannable_nodes`).
    lost_reported_at: Mapped[datetime | None]

    slots: Mapped[list[GpuSlot]] = relationship(
        back_populates="node", lazy="raise", order_by="GpuSlot.index"
    )


class GpuSlot(Base):
    """One GPU (or simulated GPU slot) of a node and the job that holds it."""

    __tablename__ = "gpu_slots"
    __table_args__ = (UniqueConstraint("node_id", "index"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    index: Mapped[int]
    uuid: Mapped[str | None] = mapped_column(String(100))
    memory_mb: Mapped[int] = mapped_column(default=0)
    job_id: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="SET NULL"), index=True
    )

    node: Mapped[Node] = relationship(back_populates="slots", lazy="raise")


class Allocation(Base):
    """One allocation command to an agent, with its per-job generation and acknowledgement."""

    __tablename__ = "allocations"
    __table_args__ = (UniqueConstraint("job_id", "generation"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    generation: Mapped[int]
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    gpus: Mapped[int]
    slot_indices: Mapped[list[int]] = mapped_column(JSON, default=list)
    # A job across nodes: its parts on further nodes, [[node_id, [slot indices]], ...]; the
    # command goes to `node_id` (the job's runner and rendezvous), which starts these parts'
    # workers through their nodes' worker hosts. None or []: the job runs inside one node.
    parts: Mapped[list[list[Any]] | None] = mapped_column(JSON)
    layout: Mapped[str | None] = mapped_column(String(32))
    # The job's power model at each GPU count (simulated slots estimate power from it).
    estimated_power_w: Mapped[dict[str, float] | None] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(Text, default="", server_default="")
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(default=0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    sent_at: Mapped[datetime | None]
    acked_at: Mapped[datetime | None]


class TelemetrySample(Base):
    """What an agent measured for a job over one reporting interval."""

    __tablename__ = "telemetry_samples"
    __table_args__ = (
        Index("ix_telemetry_samples_job_at", "job_id", "at"),
        # Only the samples the ledger has still to charge: it stays as small as the backlog,
        # however long the history (the charge used to test every sample against the ledger).
        Index(
            "ix_telemetry_samples_uncharged",
            "id",
            sqlite_where=text("charged = 0 AND energy_kwh > 0"),
            postgresql_where=text("NOT charged AND energy_kwh > 0"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    # Agent-chosen id: a retried report is stored once.
    sample_id: Mapped[str] = mapped_column(String(64), unique=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    at: Mapped[datetime]
    interval_s: Mapped[float]
    step: Mapped[int] = mapped_column(BigInteger)
    samples_done: Mapped[int] = mapped_column(BigInteger)
    samples_per_s: Mapped[float]
    loss: Mapped[float | None]
    gpus: Mapped[int]
    layout: Mapped[str | None] = mapped_column(String(32))
    power_w: Mapped[float]
    energy_kwh: Mapped[float]
    power_source: Mapped[str] = mapped_column(String(16))
    # Set once the ledger has charged the sample's energy (`charge_new_telemetry`).
    charged: Mapped[bool] = mapped_column(default=False, server_default=text("false"))


class CarbonIntensitySample(Base):
    """A measured or estimated carbon intensity of a region at one time."""

    __tablename__ = "carbon_intensity_samples"
    __table_args__ = (UniqueConstraint("region", "source", "signal", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    region: Mapped[str] = mapped_column(String(100))
    source: Mapped[str] = mapped_column(String(500))
    signal: Mapped[str] = mapped_column(String(32))
    at: Mapped[datetime]
    intensity_g_per_kwh: Mapped[float]
    kind: Mapped[str] = mapped_column(String(16))
    fetched_at: Mapped[datetime]


class CarbonForecastRecord(Base):
    """A forecast as fetched (points in JSON), kept for the console and for audits."""

    __tablename__ = "carbon_forecasts"
    __table_args__ = (Index("ix_carbon_forecasts_region_fetched", "region", "fetched_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    region: Mapped[str] = mapped_column(String(100))
    source: Mapped[str] = mapped_column(String(500))
    signal: Mapped[str] = mapped_column(String(32))
    fetched_at: Mapped[datetime]
    degraded: Mapped[bool] = mapped_column(default=False)
    degraded_reason: Mapped[str | None] = mapped_column(Text)
    # [{"at": iso, "intensity_g_per_kwh": float, "kind": str}, ...]
    points: Mapped[list[dict[str, Any]]] = mapped_column(JSON)


class NodePowerSampleRow(Base):
    """What one node drew over one interval: every GPU (busy or idle) and its host."""

    __tablename__ = "node_power_samples"
    __table_args__ = (Index("ix_node_power_samples_node_at", "node_id", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    # Agent-chosen id: a retried report is stored once.
    sample_id: Mapped[str] = mapped_column(String(64), unique=True)
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    at: Mapped[datetime]
    interval_s: Mapped[float]
    # Set once the ledger has charged the sample's idle-GPU and host energy.
    charged: Mapped[bool] = mapped_column(default=False, server_default=text("false"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    readings: Mapped[list[NodePowerReading]] = relationship(
        back_populates="sample", lazy="raise", order_by="NodePowerReading.id"
    )


class NodePowerReading(Base):
    """One GPU's or the host's energy in a node power sample, with where it came from."""

    __tablename__ = "node_power_readings"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    sample_id: Mapped[int] = mapped_column(
        ForeignKey("node_power_samples.id", ondelete="CASCADE"), index=True
    )
    component: Mapped[str] = mapped_column(String(8))  # "gpu" or "host"
    device: Mapped[str] = mapped_column(String(32))
    # The job holding the GPU at the end of the interval (its own telemetry charges it).
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    energy_j: Mapped[float]
    source: Mapped[str] = mapped_column(String(16))  # nvml, dcgm, rapl or estimated

    sample: Mapped[NodePowerSampleRow] = relationship(back_populates="readings", lazy="raise")


class LedgerEntry(Base):
    """Emissions charged for one interval inside one budget period: a job's GPU energy, or a
    share of idle-GPU or host energy (attributed to a job, or the cluster's when job_id is None)."""

    __tablename__ = "ledger_entries"
    __table_args__ = (Index("ix_ledger_entries_period", "period_start"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    # Each telemetry sample is charged at most once.
    telemetry_sample_id: Mapped[int | None] = mapped_column(
        ForeignKey("telemetry_samples.id", ondelete="SET NULL"), unique=True
    )
    # "gpu" (a job's own telemetry), "idle" (GPUs no job held) or "host".
    component: Mapped[str] = mapped_column(String(8), default="gpu", server_default="gpu")
    # nvml, dcgm, rapl or estimated ("unknown" for entries made before sources were kept).
    power_source: Mapped[str] = mapped_column(
        String(16), default="unknown", server_default="unknown"
    )
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    node_power_sample_id: Mapped[int | None] = mapped_column(
        ForeignKey("node_power_samples.id", ondelete="SET NULL"), index=True
    )
    # The intensity signal(s) in force ("<source> <signal> <region>", "conservative" where no
    # measurement was known), joined by "; ".
    intensity_source: Mapped[str] = mapped_column(Text, default="", server_default="")
    period_start: Mapped[datetime]
    period_end: Mapped[datetime]
    interval_start: Mapped[datetime]
    interval_end: Mapped[datetime]
    energy_kwh: Mapped[float]
    pue: Mapped[float]
    intensity_g_per_kwh: Mapped[float]
    emissions_kg: Mapped[float]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Plan(Base):
    """An allocation plan the control loop made (the newest one is the current plan)."""

    __tablename__ = "plans"
    __table_args__ = (Index("ix_plans_created_at", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    start_at: Mapped[datetime]
    slot_s: Mapped[float]
    policy: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(32))
    gap: Mapped[float | None]
    solve_s: Mapped[float]
    energy_kwh: Mapped[float]
    emissions_kg: Mapped[float]
    forecast_degraded: Mapped[bool] = mapped_column(default=False)
    # [{"capacity_gpus", "intensity_g_per_kwh", "energy_kwh", "emissions_kg"}, ...] per slot
    slots: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    # The GPUs per job and slot and the deadline misses are stored once, in `jobs` (plan_jobs):
    # stored here as well, as JSON, they were a second copy of 1.4 M counts a tick at 5,000 jobs.
    num_slots: Mapped[int] = mapped_column(default=0, server_default="0")
    # GPUs planned per slot, summed over jobs
    total_gpus: Mapped[list[int]] = mapped_column(JSON, default=list)

    jobs: Mapped[list[PlanJob]] = relationship(
        lazy="raise", cascade="all, delete-orphan", passive_deletes=True
    )


class PlanJob(Base):
    """One job's part of a plan: its GPUs per slot and why its deadline is missed (if it is).

    `gpus` ends at the job's last planned GPU (trailing zeros are not stored: most of 5,000
    queued jobs are planned none); `dispatch.plans.padded` gives it the plan's length back."""

    __tablename__ = "plan_jobs"

    plan_id: Mapped[int] = mapped_column(
        ForeignKey("plans.id", ondelete="CASCADE"), primary_key=True
    )
    # No foreign key: a plan is a record of what was decided, kept whatever happens to the job.
    job_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    gpus: Mapped[list[int]] = mapped_column(JSON)
    deadline_miss: Mapped[str | None] = mapped_column(Text)
