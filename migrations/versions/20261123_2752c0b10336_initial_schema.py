"""initial schema

Revision ID: 2752c0b10336
Revises:
Create Date: 2026-11-23 07:12:12.784786
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2752c0b10336"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table(
        "api_tokens",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("token_id", sa.String(length=32), nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_id", name=op.f("uq_api_tokens_token_id")),
    )
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_tokens_name"), ["name"], unique=False)

    op.create_table(
        "carbon_forecasts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("region", sa.String(length=100), nullable=False),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.Column("signal", sa.String(length=32), nullable=False),
        sa.Column("fetched_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("degraded", sa.Boolean(), nullable=False),
        sa.Column("degraded_reason", sa.Text(), nullable=True),
        sa.Column("points", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_carbon_forecasts")),
    )
    with op.batch_alter_table("carbon_forecasts", schema=None) as batch_op:
        batch_op.create_index(
            "ix_carbon_forecasts_region_fetched", ["region", "fetched_at"], unique=False
        )

    op.create_table(
        "carbon_intensity_samples",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("region", sa.String(length=100), nullable=False),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.Column("signal", sa.String(length=32), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("intensity_g_per_kwh", sa.Double(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("fetched_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_carbon_intensity_samples")),
        sa.UniqueConstraint(
            "region",
            "source",
            "signal",
            "at",
            name=op.f("uq_carbon_intensity_samples_region_source_signal_at"),
        ),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("owner", sa.String(length=100), nullable=False),
        sa.Column("submission_id", sa.String(length=128), nullable=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("workload", sa.String(length=200), nullable=False),
        sa.Column("global_batch_size", sa.Integer(), nullable=False),
        sa.Column("total_samples", sa.BigInteger(), nullable=True),
        sa.Column("total_steps", sa.BigInteger(), nullable=True),
        sa.Column("min_gpus", sa.Integer(), nullable=False),
        sa.Column("max_gpus", sa.Integer(), nullable=False),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("begin_after", sa.DateTime(timezone=True), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("queue", sa.String(length=64), nullable=False),
        sa.Column("best_effort", sa.Boolean(), nullable=False),
        sa.Column("run_past_deadline", sa.Boolean(), nullable=False),
        sa.Column("held", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(length=24), nullable=False),
        sa.Column("state_reason", sa.Text(), nullable=False),
        sa.Column("samples_done", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("current_gpus", sa.Integer(), nullable=False),
        sa.Column("current_layout", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("owner", "submission_id", name=op.f("uq_jobs_owner_submission_id")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_owner"), ["owner"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_state"), ["state"], unique=False)
        batch_op.create_index("ix_jobs_state_created", ["state", "created_at"], unique=False)

    op.create_table(
        "nodes",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("agent_url", sa.String(length=500), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("gpu_kind", sa.String(length=64), nullable=False),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("name", name=op.f("uq_nodes_name")),
    )
    op.create_table(
        "allocations",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("slot_indices", sa.JSON(), nullable=False),
        sa.Column("layout", sa.String(length=32), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_allocations_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_allocations_node_id_nodes"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_allocations")),
        sa.UniqueConstraint("job_id", "generation", name=op.f("uq_allocations_job_id_generation")),
    )
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_allocations_job_id"), ["job_id"], unique=False)

    op.create_table(
        "gpu_slots",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("node_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("uuid", sa.String(length=100), nullable=True),
        sa.Column("memory_mb", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_gpu_slots_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_gpu_slots_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_slots")),
        sa.UniqueConstraint("node_id", "index", name=op.f("uq_gpu_slots_node_id_index")),
    )
    with op.batch_alter_table("gpu_slots", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_gpu_slots_job_id"), ["job_id"], unique=False)

    op.create_table(
        "job_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=24), nullable=False),
        sa.Column("from_state", sa.String(length=24), nullable=True),
        sa.Column("to_state", sa.String(length=24), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(length=100), nullable=False),
        sa.Column("details", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_events_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_events")),
    )
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_events_job_id"), ["job_id"], unique=False)

    op.create_table(
        "telemetry_samples",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("sample_id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("node_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("interval_s", sa.Double(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("samples_done", sa.BigInteger(), nullable=False),
        sa.Column("samples_per_s", sa.Double(), nullable=False),
        sa.Column("loss", sa.Double(), nullable=True),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("layout", sa.String(length=32), nullable=True),
        sa.Column("power_w", sa.Double(), nullable=False),
        sa.Column("energy_kwh", sa.Double(), nullable=False),
        sa.Column("power_source", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_telemetry_samples_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_telemetry_samples_node_id_nodes"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_telemetry_samples")),
        sa.UniqueConstraint("sample_id", name=op.f("uq_telemetry_samples_sample_id")),
    )
    with op.batch_alter_table("telemetry_samples", schema=None) as batch_op:
        batch_op.create_index("ix_telemetry_samples_job_at", ["job_id", "at"], unique=False)

    op.create_table(
        "ledger_entries",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column(
            "telemetry_sample_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=True,
        ),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("period_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("interval_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("interval_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("energy_kwh", sa.Double(), nullable=False),
        sa.Column("pue", sa.Double(), nullable=False),
        sa.Column("intensity_g_per_kwh", sa.Double(), nullable=False),
        sa.Column("emissions_kg", sa.Double(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_ledger_entries_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["telemetry_sample_id"],
            ["telemetry_samples.id"],
            name=op.f("fk_ledger_entries_telemetry_sample_id_telemetry_samples"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_entries")),
        sa.UniqueConstraint(
            "telemetry_sample_id", name=op.f("uq_ledger_entries_telemetry_sample_id")
        ),
    )
    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.create_index("ix_ledger_entries_period", ["period_start"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.drop_index("ix_ledger_entries_period")

    op.drop_table("ledger_entries")
    with op.batch_alter_table("telemetry_samples", schema=None) as batch_op:
        batch_op.drop_index("ix_telemetry_samples_job_at")

    op.drop_table("telemetry_samples")
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_events_job_id"))

    op.drop_table("job_events")
    with op.batch_alter_table("gpu_slots", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gpu_slots_job_id"))

    op.drop_table("gpu_slots")
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_allocations_job_id"))

    op.drop_table("allocations")
    op.drop_table("nodes")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_state_created")
        batch_op.drop_index(batch_op.f("ix_jobs_state"))
        batch_op.drop_index(batch_op.f("ix_jobs_owner"))

    op.drop_table("jobs")
    op.drop_table("carbon_intensity_samples")
    with op.batch_alter_table("carbon_forecasts", schema=None) as batch_op:
        batch_op.drop_index("ix_carbon_forecasts_region_fetched")

    op.drop_table("carbon_forecasts")
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_tokens_name"))

    op.drop_table("api_tokens")
