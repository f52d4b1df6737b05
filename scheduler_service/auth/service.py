"""Issue and verify API tokens."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from scheduler_service.auth.repository import TokenRepository
from scheduler_service.auth.tokens import Role, hash_secret, mint_token, secret_matches, split_token
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


def import_token(session: Session, *, name: str, role: Role, plaintext: str) -> bool:
    """Store a token chosen elsewhere (e.g. a deployment secret); False when it is already stored."""
    parts = split_token(plaintext)
    if parts is None:
        raise ValueError(
            "token must look like gf_<id>_<secret> (as `greenflow token create` prints)"
        )
    token_id, secret = parts
    if len(secret) < 32:
        raise ValueError("the secret part of the token must be at least 32 characters")
    repo = TokenRepository(session)
    existing = repo.by_token_id(token_id)
    if existing is not None:
        if not secret_matches(secret, existing.secret_sha256) or existing.role != role.value:
            raise ValueError(f"a different token with id {token_id} is already stored")
        return False
    repo.add(
        ApiToken(token_id=token_id, secret_sha256=hash_secret(secret), name=name, role=role.value)
    )
    return True


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
