"""plans stored per job (plan_jobs) with their slot count and per-slot GPU totals

Readers of one job's plan, a user's plan and the carbon chart read these instead of parsing the
whole plan's JSON, which grows with jobs x slots.

Revision ID: e5a7c9d1f3b4
Revises: 4472019e3fbb
Create Date: 2026-11-27 20:50:00
"""

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "e5a7c9d1f3b4"
down_revision: str | None = "4472019e3fbb"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _loaded(value: Any) -> Any:
    # SQLite hands JSON back as text here; PostgreSQL's driver parses it.
    return json.loads(value) if isinstance(value, str) else value


def upgrade() -> None:
    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("num_slots", sa.Integer(), server_default="0", nullable=False)
        )
        batch_op.add_column(sa.Column("total_gpus", sa.JSON(), nullable=True))

    # Backfill the plans kept so far (a handful: the control loop prunes old ones).
    bind = op.get_bind()
    plans = sa.table(
        "plans",
        sa.column("id", sa.Integer()),
        sa.column("gpus_by_job", sa.Text()),
        sa.column("slots", sa.Text()),
        sa.column("deadline_misses", sa.Text()),
        sa.column("num_slots", sa.Integer()),
        sa.column("total_gpus", sa.JSON()),
    )
    plan_jobs = sa.table(
        "plan_jobs",
        sa.column("plan_id", sa.Integer()),
        sa.column("job_id", sa.BigInteger()),
        sa.column("gpus", sa.JSON()),
        sa.column("deadline_miss", sa.Text()),
    )
    job_rows: list[dict[str, Any]] = []
    rows = bind.execute(
        sa.select(plans.c.id, plans.c.gpus_by_job, plans.c.slots, plans.c.deadline_misses)
    ).all()
    for plan_id, gpus_raw, slots_raw, misses_raw in rows:
        gpus_by_job: dict[str, list[int]] = _loaded(gpus_raw) or {}
        misses: dict[str, str] = _loaded(misses_raw) or {}
        num_slots = len(_loaded(slots_raw) or [])
        length = max([num_slots, *(len(c) for c in gpus_by_job.values())])
        totals = [0] * length
        for counts in gpus_by_job.values():
            for index, gpus in enumerate(counts):
                totals[index] += gpus
        bind.execute(
            plans.update()
            .where(plans.c.id == plan_id)
            .values(num_slots=num_slots, total_gpus=totals)
        )
        job_rows.extend(
            {
                "plan_id": plan_id,
                "job_id": int(job_id),
                "gpus": gpus_by_job.get(job_id, []),
                "deadline_miss": misses.get(job_id),
            }
            for job_id in sorted({*gpus_by_job, *misses}, key=int)
        )
    bind.execute(plans.update().where(plans.c.total_gpus.is_(None)).values(total_gpus=[]))
    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.alter_column("total_gpus", existing_type=sa.JSON(), nullable=False)

    # Created after the last change to `plans`: on SQLite that change copies the table and drops
    # the old one, which would cascade to rows referencing it.
    op.create_table(
        "plan_jobs",
        sa.Column("plan_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("deadline_miss", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["plan_id"], ["plans.id"], name=op.f("fk_plan_jobs_plan_id_plans"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("plan_id", "job_id", name=op.f("pk_plan_jobs")),
    )
    if job_rows:
        bind.execute(plan_jobs.insert(), job_rows)


def downgrade() -> None:
    op.drop_table("plan_jobs")
    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.drop_column("total_gpus")
        batch_op.drop_column("num_slots")
