"""Issue and verify API tokens."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from scheduler_service.auth.repository import TokenRepository
from scheduler_service.auth.tokens import Role, mint_token, secret_matches, split_token
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import ApiToken


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name and role."""

    name: str
    role: Role
    token_id: str

    @property
    def is_operator(self) -> bool:
        """Operators see and change everything."""
        return self.role is Role.OPERATOR


def create_token(session: Session, *, name: str, role: Role) -> str:
    """Store a new token's hash and return its plaintext (shown once)."""
    if not name.strip():
        raise ValueError("token name must not be empty")
    new = mint_token()
    TokenRepository(session).add(
        ApiToken(token_id=new.token_id, secret_sha256=new.secret_sha256, name=name, role=role.value)
    )
    return new.plaintext


def authenticate(session: Session, plaintext: str) -> Principal | None:
    """The principal for a presented token, or None when it is unknown, revoked or wrong."""
    parts = split_token(plaintext)
    if parts is None:
        return None
    token_id, secret = parts
    row = TokenRepository(session).by_token_id(token_id)
    if row is None or row.revoked_at is not None or not secret_matches(secret, row.secret_sha256):
        return None
    now = utcnow()
    # Coarse bookkeeping: one write per token per few minutes, not one per request.
    if row.last_used_at is None or (now - row.last_used_at).total_seconds() > 300:
        row.last_used_at = now
    return Principal(name=row.name, role=Role(row.role), token_id=row.token_id)
