"""nodes: the address other nodes reach them on (rendezvous host, worker host port);
allocations: a job's parts on further nodes (a job across nodes)

Revision ID: b3c5e7a9d1f2
Revises: e9afd2dcbb35
Create Date: 2026-11-28 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b3c5e7a9d1f2"
down_revision: str | None = "e9afd2dcbb35"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rendezvous_host", sa.String(length=253), nullable=True))
        batch_op.add_column(sa.Column("worker_host_port", sa.Integer(), nullable=True))
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("parts", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_column("parts")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("worker_host_port")
        batch_op.drop_column("rendezvous_host")
