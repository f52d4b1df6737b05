"""Token format, hashing and constant-time verification (no database access here)."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum

TOKEN_PREFIX = "gf"
# ASCII only, bounded: anything else is rejected before it reaches the database or a hash.
_TOKEN_RE = re.compile(r"gf_([A-Za-z0-9]{1,32})_([A-Za-z0-9_\-]{1,256})")
TOKEN_ID_RE = re.compile(r"[A-Za-z0-9]{1,32}")
# Token names are identities (job owners, node names): printable ASCII words.
NAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,100}")


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
    match = _TOKEN_RE.fullmatch(plaintext)
    if match is None:
        return None
    return match.group(1), match.group(2)


def valid_name(name: str) -> bool:
    """Whether `name` may name a token (and so a job owner or a node)."""
    return NAME_RE.fullmatch(name) is not None


def secret_matches(secret: str, stored_sha256: str) -> bool:
    """Constant-time comparison of a presented secret with the stored hash."""
    return hmac.compare_digest(hash_secret(secret), stored_sha256)
