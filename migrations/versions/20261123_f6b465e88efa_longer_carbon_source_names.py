"""longer carbon source names

Revision ID: f6b465e88efa
Revises: 37c9972d4e7c
Create Date: 2026-11-23 07:38:28.393327
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f6b465e88efa"
down_revision: str | None = "37c9972d4e7c"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("carbon_forecasts", schema=None) as batch_op:
        batch_op.alter_column(
            "source",
            existing_type=sa.VARCHAR(length=64),
            type_=sa.String(length=500),
            existing_nullable=False,
        )

    with op.batch_alter_table("carbon_intensity_samples", schema=None) as batch_op:
        batch_op.alter_column(
            "source",
            existing_type=sa.VARCHAR(length=64),
            type_=sa.String(length=500),
            existing_nullable=False,
        )


def downgrade() -> None:
    with op.batch_alter_table("carbon_intensity_samples", schema=None) as batch_op:
        batch_op.alter_column(
            "source",
            existing_type=sa.String(length=500),
            type_=sa.VARCHAR(length=64),
            existing_nullable=False,
        )

    with op.batch_alter_table("carbon_forecasts", schema=None) as batch_op:
        batch_op.alter_column(
            "source",
            existing_type=sa.String(length=500),
            type_=sa.VARCHAR(length=64),
            existing_nullable=False,
        )
