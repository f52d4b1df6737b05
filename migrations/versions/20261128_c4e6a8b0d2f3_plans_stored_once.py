"""a plan's GPUs per job and its deadline misses stored once, as plan_jobs rows

`plans.gpus_by_job` and `plans.deadline_misses` repeated what `plan_jobs` holds (about 1.4 M GPU
counts a tick at 5,000 jobs x 288 slots, JSON-encoded twice). Every reader reads `plan_jobs`.
The rows' GPU lists now end at the job's last planned GPU (at least one slot kept); rows stored
before keep their full length, which reads back the same.

Revision ID: c4e6a8b0d2f3
Revises: a2b4c6d8e0f1
Create Date: 2026-11-28 06:00:00
"""

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "c4e6a8b0d2f3"
down_revision: str | None = "a2b4c6d8e0f1"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _loaded(value: Any) -> Any:
    # SQLite hands JSON back as text here; PostgreSQL's driver parses it.
    return json.loads(value) if isinstance(value, str) else value


def upgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN on SQLite too (3.35+): a batch copy of `plans` would drop
    # the old table, and with it (ON DELETE CASCADE) every plan_jobs row.
    op.drop_column("plans", "gpus_by_job")
    op.drop_column("plans", "deadline_misses")


def downgrade() -> None:
    op.add_column("plans", sa.Column("gpus_by_job", sa.JSON(), nullable=True))
    op.add_column("plans", sa.Column("deadline_misses", sa.JSON(), nullable=True))
    bind = op.get_bind()
    plans = sa.table(
        "plans",
        sa.column("id", sa.Integer()),
        sa.column("num_slots", sa.Integer()),
        sa.column("gpus_by_job", sa.JSON()),
        sa.column("deadline_misses", sa.JSON()),
    )
    plan_jobs = sa.table(
        "plan_jobs",
        sa.column("plan_id", sa.Integer()),
        sa.column("job_id", sa.BigInteger()),
        sa.column("gpus", sa.Text()),
        sa.column("deadline_miss", sa.Text()),
    )
    num_slots = dict(bind.execute(sa.select(plans.c.id, plans.c.num_slots)).all())
    gpus: dict[int, dict[str, list[int]]] = {plan_id: {} for plan_id in num_slots}
    misses: dict[int, dict[str, str]] = {plan_id: {} for plan_id in num_slots}
    for plan_id, job_id, counts_raw, miss in bind.execute(
        sa.select(
            plan_jobs.c.plan_id, plan_jobs.c.job_id, plan_jobs.c.gpus, plan_jobs.c.deadline_miss
        )
    ):
        counts: list[int] = _loaded(counts_raw) or []
        if counts:
            gpus[plan_id][str(job_id)] = counts + [0] * (num_slots[plan_id] - len(counts))
        if miss is not None:
            misses[plan_id][str(job_id)] = miss
    for plan_id in num_slots:
        bind.execute(
            plans.update()
            .where(plans.c.id == plan_id)
            .values(gpus_by_job=gpus[plan_id], deadline_misses=misses[plan_id])
        )
    if bind.dialect.name != "sqlite":
        # Not on SQLite: its batch copy of `plans` would cascade to the plan_jobs rows.
        op.alter_column("plans", "gpus_by_job", existing_type=sa.JSON(), nullable=False)
        op.alter_column("plans", "deadline_misses", existing_type=sa.JSON(), nullable=False)
