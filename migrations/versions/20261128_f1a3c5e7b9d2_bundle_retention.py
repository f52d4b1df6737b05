"""bundle retention: when a bundle was last used, and when its bytes were removed

Revision ID: f1a3c5e7b9d2
Revises: b3c5e7a9d1f2
Create Date: 2026-11-28 00:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f1a3c5e7b9d2"
down_revision: str | None = "b3c5e7a9d1f2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("bundles", schema=None) as batch_op:
        batch_op.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("removed_at", sa.DateTime(timezone=True), nullable=True))
    # Stored bundles were last used when they were uploaded, as far as anyone knows.
    op.execute("UPDATE bundles SET last_used_at = created_at")
    with op.batch_alter_table("bundles", schema=None) as batch_op:
        batch_op.alter_column(
            "last_used_at", existing_type=sa.DateTime(timezone=True), nullable=False
        )
        batch_op.create_index(batch_op.f("ix_bundles_last_used_at"), ["last_used_at"])
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_bundle_sha256"), ["bundle_sha256"])


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_bundle_sha256"))
    with op.batch_alter_table("bundles", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_bundles_last_used_at"))
        batch_op.drop_column("removed_at")
        batch_op.drop_column("last_used_at")
