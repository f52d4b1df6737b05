"""Bundle use-cases: store a user's upload, hand it to the agents that run its jobs.

The scheduler only checks the bytes' SHA-256 and size: it never unpacks or imports a bundle.
Never commits; the caller does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from scheduler_service.auth.service import Principal
from scheduler_service.auth.tokens import Role
from scheduler_service.bundles.repository import BundleRepository
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Bundle
from scheduler_service.exceptions import FieldError, GreenflowError


class BundleNotFound(GreenflowError):
    """No such bundle, or not one the caller may read (the two look the same on purpose)."""

    def __init__(self, sha256: str, why: str = "not found") -> None:
        super().__init__(f"bundle {sha256} {why}", 404)


@dataclass(frozen=True)
class SweepReport:
    """What one retention sweep removed."""

    removed: list[str]
    freed_bytes: int


@dataclass(frozen=True)
class StoreResult:
    """The stored bundle's name and size, and whether this call stored it."""

    sha256: str
    size_bytes: int
    created: bool


def store_bundle(
    session: Session, principal: Principal, sha256: str, data: bytes, max_bytes: int
) -> StoreResult:
    """Store `data` under its SHA-256 (which must be `sha256`); a repeat upload is harmless."""
    if not data:
        raise FieldError("body", "empty bundle")
    if len(data) > max_bytes:
        raise FieldError("body", f"bundle of {len(data)} bytes is over the {max_bytes}-byte limit")
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise FieldError("sha256", f"the body hashes to {actual}, not {sha256}")
    repo = BundleRepository(session)
    now = utcnow()
    if repo.touch(sha256, now):  # stored: uploading it again counts as a use
        return StoreResult(sha256, repo.size_of(sha256) or len(data), created=False)
    if repo.removed_at(sha256) is not None:
        # The retention sweep removed its bytes: the same bytes (same hash) come back.
        repo.restore(sha256, data, now)
        return StoreResult(sha256, len(data), created=True)
    repo.add(
        Bundle(
            sha256=sha256,
            owner=principal.name,
            size_bytes=len(data),
            data=data,
            created_at=now,
            last_used_at=now,
        )
    )
    return StoreResult(sha256, len(data), created=True)


def read_bundle(session: Session, principal: Principal, sha256: str) -> bytes:
    """The bundle's bytes, for its uploader, users whose jobs use it, operators, and the agents
    of nodes that run one of its jobs."""
    repo = BundleRepository(session)
    bundle = repo.get(sha256)
    if bundle is None:
        raise BundleNotFound(sha256)
    if bundle.removed_at is not None:
        # Who may know that it existed is checked below; everyone else sees "not found".
        removed = BundleNotFound(
            sha256,
            f"was removed at {bundle.removed_at:%Y-%m-%d %H:%M} UTC after its retention period "
            "unused: upload it again (`greenflow submit --workdir DIR` does)",
        )
    else:
        removed = None
    allowed = (
        principal.is_operator
        or bundle.owner == principal.name
        or (principal.role is Role.AGENT and repo.used_on_node(sha256, principal.name))
        or (principal.role is Role.USER and repo.used_by(sha256, principal.name))
    )
    if not allowed:
        raise BundleNotFound(sha256)
    if removed is not None:
        raise removed
    return bundle.data


def require_bundle(session: Session, sha256: str) -> None:
    """Raise a 422 naming `bundle` unless a bundle with this SHA-256 is stored; mark it used
    (so the retention sweep keeps it, also if it runs while this submission commits)."""
    repo = BundleRepository(session)
    if repo.touch(sha256, utcnow()):
        return
    removed_at = repo.removed_at(sha256)
    if removed_at is not None:
        raise FieldError(
            "bundle",
            f"bundle {sha256} was removed at {removed_at:%Y-%m-%d %H:%M} UTC after its retention "
            "period unused: upload it again (`greenflow submit --workdir DIR` does)",
        )
    raise FieldError(
        "bundle",
        f"no bundle {sha256} is stored: upload it first (`greenflow submit --workdir DIR` does)",
    )


def sweep_bundles(session: Session, now: datetime, retention: timedelta) -> SweepReport:
    """Remove the bytes of bundles no job needs and nobody used for `retention`: not uploaded
    or named by a job since, used by no unfinished job, and by none that finished since."""
    removed = BundleRepository(session).sweep(now - retention, now)
    return SweepReport([sha for sha, _ in removed], sum(size for _, size in removed))
