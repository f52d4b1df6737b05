"""agent secret, plans, allocation power model

Revision ID: 37c9972d4e7c
Revises: 2752c0b10336
Create Date: 2026-11-23 07:23:55.098636
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "37c9972d4e7c"
down_revision: str | None = "2752c0b10336"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "plans",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("start_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("slot_s", sa.Double(), nullable=False),
        sa.Column("policy", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("gap", sa.Double(), nullable=True),
        sa.Column("solve_s", sa.Double(), nullable=False),
        sa.Column("energy_kwh", sa.Double(), nullable=False),
        sa.Column("emissions_kg", sa.Double(), nullable=False),
        sa.Column("forecast_degraded", sa.Boolean(), nullable=False),
        sa.Column("gpus_by_job", sa.JSON(), nullable=False),
        sa.Column("slots", sa.JSON(), nullable=False),
        sa.Column("deadline_misses", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plans")),
    )
    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.create_index("ix_plans_created_at", ["created_at"], unique=False)

    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("estimated_power_w", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("reason", sa.Text(), server_default="", nullable=False))

    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("agent_secret", sa.String(length=200), server_default="", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("agent_secret")

    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_column("reason")
        batch_op.drop_column("estimated_power_w")

    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.drop_index("ix_plans_created_at")

    op.drop_table("plans")
