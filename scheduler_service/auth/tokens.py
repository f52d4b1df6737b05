"""Token format, hashing and constant-time verification (no database access here)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from enum import StrEnum

TOKEN_PREFIX = "gf"


class Role(StrEnum):
    """What a token may do."""

    USER = "user"
    OPERATOR = "operator"
    AGENT = "agent"


@dataclass(frozen=True)
class NewToken:
    """A freshly minted token: `plaintext` is shown once and never stored."""

    token_id: str
    plaintext: str
    secret_sha256: str


def hash_secret(secret: str) -> str:
    """SHA-256 of a token secret (the secret has 256 bits of entropy, so no slow KDF is needed)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def mint_token() -> NewToken:
    """Create a token `gf_<id>_<secret>`; the id is for lookup, the secret is checked by hash."""
    token_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    return NewToken(token_id, f"{TOKEN_PREFIX}_{token_id}_{secret}", hash_secret(secret))


def split_token(plaintext: str) -> tuple[str, str] | None:
    """(token_id, secret) of a well-formed token, else None."""
    parts = plaintext.split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def secret_matches(secret: str, stored_sha256: str) -> bool:
    """Constant-time comparison of a presented secret with the stored hash."""
    return hmac.compare_digest(hash_secret(secret), stored_sha256)
