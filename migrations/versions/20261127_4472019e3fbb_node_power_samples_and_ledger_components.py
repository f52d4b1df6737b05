"""node power samples (every GPU, busy or idle, and the host) and ledger components and sources

Revision ID: 4472019e3fbb
Revises: d4f6a8c0e2b1
Create Date: 2026-11-27 20:27:50.552890
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "4472019e3fbb"
down_revision: str | None = "d4f6a8c0e2b1"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "node_power_samples",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("sample_id", sa.String(length=64), nullable=False),
        sa.Column("node_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("interval_s", sa.Double(), nullable=False),
        sa.Column("charged", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_node_power_samples_node_id_nodes"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_power_samples")),
        sa.UniqueConstraint("sample_id", name=op.f("uq_node_power_samples_sample_id")),
    )
    with op.batch_alter_table("node_power_samples", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_node_power_samples_charged"), ["charged"], unique=False
        )
        batch_op.create_index("ix_node_power_samples_node_at", ["node_id", "at"], unique=False)

    op.create_table(
        "node_power_readings",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column(
            "sample_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("component", sa.String(length=8), nullable=False),
        sa.Column("device", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("energy_j", sa.Double(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_node_power_readings_job_id_jobs"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["sample_id"],
            ["node_power_samples.id"],
            name=op.f("fk_node_power_readings_sample_id_node_power_samples"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_power_readings")),
    )
    with op.batch_alter_table("node_power_readings", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_node_power_readings_sample_id"), ["sample_id"], unique=False
        )

    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("component", sa.String(length=8), server_default="gpu", nullable=False)
        )
        batch_op.add_column(
            sa.Column(
                "power_source", sa.String(length=16), server_default="unknown", nullable=False
            )
        )
        batch_op.add_column(
            sa.Column(
                "node_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
            )
        )
        batch_op.add_column(
            sa.Column(
                "node_power_sample_id",
                sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                nullable=True,
            )
        )
        batch_op.add_column(
            sa.Column("intensity_source", sa.Text(), server_default="", nullable=False)
        )
        batch_op.create_index(
            batch_op.f("ix_ledger_entries_node_power_sample_id"),
            ["node_power_sample_id"],
            unique=False,
        )
        batch_op.create_foreign_key(
            batch_op.f("fk_ledger_entries_node_power_sample_id_node_power_samples"),
            "node_power_samples",
            ["node_power_sample_id"],
            ["id"],
            ondelete="SET NULL",
        )
        batch_op.create_foreign_key(
            batch_op.f("fk_ledger_entries_node_id_nodes"),
            "nodes",
            ["node_id"],
            ["id"],
            ondelete="SET NULL",
        )

    # Entries of a job's own telemetry take that sample's power source.
    op.execute(
        "UPDATE ledger_entries SET power_source = (SELECT t.power_source FROM telemetry_samples t"
        " WHERE t.id = ledger_entries.telemetry_sample_id) WHERE telemetry_sample_id IS NOT NULL"
    )


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_ledger_entries_node_id_nodes"), type_="foreignkey")
        batch_op.drop_constraint(
            batch_op.f("fk_ledger_entries_node_power_sample_id_node_power_samples"),
            type_="foreignkey",
        )
        batch_op.drop_index(batch_op.f("ix_ledger_entries_node_power_sample_id"))
        batch_op.drop_column("intensity_source")
        batch_op.drop_column("node_power_sample_id")
        batch_op.drop_column("node_id")
        batch_op.drop_column("power_source")
        batch_op.drop_column("component")

    with op.batch_alter_table("node_power_readings", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_node_power_readings_sample_id"))

    op.drop_table("node_power_readings")
    with op.batch_alter_table("node_power_samples", schema=None) as batch_op:
        batch_op.drop_index("ix_node_power_samples_node_at")
        batch_op.drop_index(batch_op.f("ix_node_power_samples_charged"))

    op.drop_table("node_power_samples")
