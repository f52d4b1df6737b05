"""Issue, list, revoke and verify API tokens (the name is the identity; one active per role)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from scheduler_service.auth.repository import TokenRepository
from scheduler_service.auth.tokens import (
    TOKEN_ID_RE,
    Role,
    hash_secret,
    mint_token,
    secret_matches,
    split_token,
    valid_name,
)
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import ApiToken


class TokenError(ValueError):
    """A token cannot be created, imported or revoked as asked (the message says why)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name and role (an agent's name is the node it speaks for)."""

    name: str
    role: Role
    token_id: str

    @property
    def is_operator(self) -> bool:
        """Operators see and change everything."""
        return self.role is Role.OPERATOR


def _check_name(name: str, role: Role) -> None:
    if not valid_name(name):
        raise TokenError(
            f"token name {name!r} is not allowed: 1-100 characters of letters, digits, "
            "'_', '.', '-' or '@'"
        )
    if role is Role.AGENT and "@" in name:
        raise TokenError(f"an agent token is named after its node; {name!r} is no node name")


def _free_name(repo: TokenRepository, *, name: str, role: Role, replace: bool) -> None:
    """Make (role, name) available: revoke expired holders; the live one only with `replace`."""
    now = utcnow()
    for row in repo.active_by_name(name, role.value):
        expired = row.expires_at is not None and row.expires_at <= now
        if expired or replace:
            row.revoked_at = now
        else:
            raise TokenError(
                f"an active {role.value} token named {name!r} exists (id {row.token_id}); "
                "revoke it first or replace it (--replace)"
            )
    repo.session.flush()


def create_token(
    session: Session,
    *,
    name: str,
    role: Role,
    expires_at: datetime | None = None,
    replace: bool = False,
) -> str:
    """Store a new token's hash and return its plaintext (shown once)."""
    _check_name(name, role)
    repo = TokenRepository(session)
    _free_name(repo, name=name, role=role, replace=replace)
    new = mint_token()
    repo.add(
        ApiToken(
            token_id=new.token_id,
            secret_sha256=new.secret_sha256,
            name=name,
            role=role.value,
            expires_at=expires_at,
        )
    )
    return new.plaintext


def import_token(session: Session, *, name: str, role: Role, plaintext: str) -> bool:
    """Store a token chosen elsewhere (e.g. a deployment secret); False when it is already stored."""
    _check_name(name, role)
    parts = split_token(plaintext)
    if parts is None:
        raise TokenError(
            "token must look like gf_<id>_<secret> (as `greenflow token create` prints)"
        )
    token_id, secret = parts
    if len(secret) < 32:
        raise TokenError("the secret part of the token must be at least 32 characters")
    repo = TokenRepository(session)
    existing = repo.by_token_id(token_id)
    if existing is not None:
        if (
            not secret_matches(secret, existing.secret_sha256)
            or existing.role != role.value
            or existing.name != name
        ):
            raise TokenError(f"a different token with id {token_id} is already stored")
        if existing.revoked_at is not None:
            raise TokenError(f"token {token_id} was revoked; create a new one")
        return False
    _free_name(repo, name=name, role=role, replace=False)
    repo.add(
        ApiToken(token_id=token_id, secret_sha256=hash_secret(secret), name=name, role=role.value)
    )
    return True


def list_tokens(session: Session, *, include_revoked: bool = False) -> list[ApiToken]:
    """Every token (never a secret), oldest first."""
    rows = TokenRepository(session).list()
    return rows if include_revoked else [r for r in rows if r.revoked_at is None]


def revoke_token(session: Session, token_id: str) -> ApiToken:
    """Revoke a token by its public id (repeating it is harmless)."""
    row = TokenRepository(session).by_token_id(token_id) if valid_token_id(token_id) else None
    if row is None:
        raise TokenError(f"no token with id {token_id!r} (see `greenflow token list`)")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    return row


def valid_token_id(token_id: str) -> bool:
    """Whether this looks like a token id."""
    return TOKEN_ID_RE.fullmatch(token_id) is not None


def authenticate(session: Session, plaintext: str) -> Principal | None:
    """The principal for a presented token, or None when it is unknown, revoked, expired or wrong.

    The same work is done whether or not the id exists (a hash comparison against a dummy), so
    the answer time does not tell which token ids exist.
    """
    found = authenticate_until(session, plaintext)
    return found[0] if found is not None else None


def authenticate_until(
    session: Session, plaintext: str
) -> tuple[Principal, datetime | None] | None:
    """As `authenticate`, with the token's expiry (None: it does not expire)."""
    parts = split_token(plaintext)
    if parts is None:
        return None
    token_id, secret = parts
    row = TokenRepository(session).by_token_id(token_id)
    stored = row.secret_sha256 if row is not None else _DUMMY_SHA256
    matches = secret_matches(secret, stored)
    if row is None or not matches or row.revoked_at is not None:
        return None
    now = utcnow()
    if row.expires_at is not None and row.expires_at <= now:
        return None
    # Coarse bookkeeping: one write per token per few minutes, not one per request.
    if row.last_used_at is None or (now - row.last_used_at).total_seconds() > 300:
        row.last_used_at = now
    return Principal(name=row.name, role=Role(row.role), token_id=row.token_id), row.expires_at


_DUMMY_SHA256 = hash_secret("greenflow-no-such-token")
