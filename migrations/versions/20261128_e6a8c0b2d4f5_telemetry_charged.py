"""telemetry_samples: a charged flag and a partial index of the uncharged (the ledger's charge
no longer tests every sample against every ledger entry)

Revision ID: e6a8c0b2d4f5
Revises: d5f7a9b1c3e4
Create Date: 2026-11-28 15:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e6a8c0b2d4f5"
down_revision: str | None = "d5f7a9b1c3e4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# SQLite matches a partial index's terms as written: the query's `NOT charged` is `charged = 0`
# there.
UNCHARGED_SQLITE = "charged = 0 AND energy_kwh > 0"
UNCHARGED_POSTGRES = "NOT charged AND energy_kwh > 0"


def upgrade() -> None:
    # Plain ALTERs, not a batch: SQLite's batch copies the table, and dropping the old one set
    # every ledger entry's telemetry_sample_id to NULL (ON DELETE SET NULL, foreign keys on).
    op.add_column(
        "telemetry_samples",
        sa.Column("charged", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    # What the ledger charged so far: the samples its entries name.
    op.execute(
        "UPDATE telemetry_samples SET charged = true WHERE id IN (SELECT telemetry_sample_id"
        " FROM ledger_entries WHERE telemetry_sample_id IS NOT NULL)"
    )
    op.create_index(
        "ix_telemetry_samples_uncharged",
        "telemetry_samples",
        ["id"],
        unique=False,
        sqlite_where=sa.text(UNCHARGED_SQLITE),
        postgresql_where=sa.text(UNCHARGED_POSTGRES),
    )


def downgrade() -> None:
    op.drop_index("ix_telemetry_samples_uncharged", table_name="telemetry_samples")
    op.drop_column("telemetry_samples", "charged")
