"""job version for optimistic concurrency

Revision ID: b5a2eb2a6b11
Revises: f6b465e88efa
Create Date: 2026-11-23 08:08:10.796046
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b5a2eb2a6b11"
down_revision: str | None = "f6b465e88efa"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("version", sa.Integer(), server_default="1", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("version")
