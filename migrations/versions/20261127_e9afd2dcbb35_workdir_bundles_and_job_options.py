"""workdir bundles (a job's code by SHA-256, stored as bytes) and job options

Revision ID: e9afd2dcbb35
Revises: e5a7c9d1f3b4
Create Date: 2026-11-27 20:26:01.531124
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e9afd2dcbb35"
down_revision: str | None = "e5a7c9d1f3b4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "bundles",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=100), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_bundles")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("bundle_sha256", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("options", sa.JSON(), nullable=True))
        batch_op.create_foreign_key(
            batch_op.f("fk_jobs_bundle_sha256_bundles"), "bundles", ["bundle_sha256"], ["sha256"]
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_jobs_bundle_sha256_bundles"), type_="foreignkey")
        batch_op.drop_column("options")
        batch_op.drop_column("bundle_sha256")

    op.drop_table("bundles")
