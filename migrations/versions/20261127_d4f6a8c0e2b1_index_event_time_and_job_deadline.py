"""indexes on job_events.at (newest-events feed) and jobs.deadline_at (deadline views)

Revision ID: d4f6a8c0e2b1
Revises: c7e9a2b4d6f8
Create Date: 2026-11-27 20:40:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "d4f6a8c0e2b1"
down_revision: str | None = "c7e9a2b4d6f8"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_events_at"), ["at"], unique=False)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_deadline_at"), ["deadline_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_deadline_at"))
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_events_at"))
