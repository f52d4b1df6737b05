"""per-node credentials: token expiry, one active token per role and name, derived agent secrets

Revision ID: a1d3e5f7b9c2
Revises: b5a2eb2a6b11
Create Date: 2026-11-27 17:30:00

Tokens that share a role and a name (possible before this revision) keep their secrets, but
all but the oldest unrevoked one are renamed `<name>~<token id>`, so each identity has one
credential. Nodes lose their stored plaintext secret: they must register again (their agents
do so at their next heartbeat, which is answered 404).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a1d3e5f7b9c2"
down_revision: str | None = "b5a2eb2a6b11"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "SELECT id, token_id, name, role FROM api_tokens WHERE revoked_at IS NULL ORDER BY id"
        )
    ).fetchall()
    seen: set[tuple[str, str]] = set()
    for row_id, token_id, name, role in rows:
        if (role, name) in seen:
            new_name = f"{name[: 99 - len(token_id)]}~{token_id}"
            conn.execute(
                sa.text("UPDATE api_tokens SET name = :name WHERE id = :id"),
                {"name": new_name, "id": row_id},
            )
        seen.add((role, name))
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(
            "uq_api_tokens_role_name_active",
            ["role", "name"],
            unique=True,
            sqlite_where=sa.text("revoked_at IS NULL"),
            postgresql_where=sa.text("revoked_at IS NULL"),
        )
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("agent_secret_nonce", sa.String(length=64), server_default="", nullable=False)
        )
        batch_op.add_column(
            sa.Column("secret_key_id", sa.String(length=16), server_default="", nullable=False)
        )
        batch_op.drop_column("agent_secret")


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("agent_secret", sa.String(length=200), server_default="", nullable=False)
        )
        batch_op.drop_column("secret_key_id")
        batch_op.drop_column("agent_secret_nonce")
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_index("uq_api_tokens_role_name_active")
        batch_op.drop_column("expires_at")
