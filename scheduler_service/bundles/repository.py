"""Queries on bundles (job code archives)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import and_, exists, func, not_, or_, select, update
from sqlalchemy.orm import Session

from scheduler_service.db.models import Bundle, GpuSlot, Job, Node
from scheduler_service.jobs.states import TERMINAL_STATES


class BundleRepository:
    """All SQL touching bundles."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, sha256: str) -> Bundle | None:
        """The bundle with this SHA-256."""
        return self.session.get(Bundle, sha256)

    def size_of(self, sha256: str) -> int | None:
        """The stored bundle's size without loading its bytes (None: no such bundle, or its
        bytes were removed)."""
        return self.session.scalar(
            select(Bundle.size_bytes).where(Bundle.sha256 == sha256, Bundle.removed_at.is_(None))
        )

    def removed_at(self, sha256: str) -> datetime | None:
        """When the retention sweep removed this bundle's bytes (None: stored, or never was)."""
        return self.session.scalar(select(Bundle.removed_at).where(Bundle.sha256 == sha256))

    def touch(self, sha256: str, now: datetime) -> bool:
        """Mark a stored bundle used now (a row lock until commit, which a concurrent sweep of
        it waits for and then sees); False if it is not stored."""
        result = self.session.execute(
            update(Bundle)
            .where(Bundle.sha256 == sha256, Bundle.removed_at.is_(None))
            .values(last_used_at=now)
            .execution_options(synchronize_session=False)
        )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    def restore(self, sha256: str, data: bytes, now: datetime) -> None:
        """Put back the bytes of a bundle the sweep removed (the same bytes: same SHA-256)."""
        self.session.execute(
            update(Bundle)
            .where(Bundle.sha256 == sha256)
            .values(data=data, size_bytes=len(data), removed_at=None, last_used_at=now)
            .execution_options(synchronize_session=False)
        )

    def sweep(self, cutoff: datetime, now: datetime) -> list[tuple[str, int]]:
        """Remove the bytes of every bundle unused since `cutoff`: not uploaded or named by a
        new job since, no unfinished job uses it, and none that used it finished since. Returns
        (sha256, size_bytes) of each removed."""
        in_use = exists().where(
            Job.bundle_sha256 == Bundle.sha256,
            or_(
                Job.state.not_in([s.value for s in TERMINAL_STATES]),
                Job.finished_at.is_(None),
                Job.finished_at >= cutoff,
            ),
        )
        idle = and_(Bundle.removed_at.is_(None), Bundle.last_used_at < cutoff, not_(in_use))
        # One UPDATE with the whole condition: a submission that touched a bundle (row lock)
        # makes this statement wait and then skip it.
        rows = self.session.execute(
            update(Bundle)
            .where(idle)
            .values(data=b"", removed_at=now)
            .returning(Bundle.sha256, Bundle.size_bytes)
            .execution_options(synchronize_session=False)
        ).all()
        return [(sha, size) for sha, size in rows]

    def stored_bytes(self) -> int:
        """Bytes of all bundles still stored."""
        total = self.session.scalar(
            select(func.coalesce(func.sum(Bundle.size_bytes), 0)).where(Bundle.removed_at.is_(None))
        )
        return int(total or 0)

    def add(self, bundle: Bundle) -> None:
        """Stage a new bundle."""
        self.session.add(bundle)
        self.session.flush()

    def used_on_node(self, sha256: str, node_name: str) -> bool:
        """Whether a job using this bundle holds slots of the named node."""
        return bool(
            self.session.scalar(
                select(
                    exists()
                    .where(Job.bundle_sha256 == sha256)
                    .where(GpuSlot.job_id == Job.id)
                    .where(GpuSlot.node_id == Node.id)
                    .where(Node.name == node_name)
                )
            )
        )

    def used_by(self, sha256: str, owner: str) -> bool:
        """Whether one of `owner`'s jobs uses this bundle."""
        return bool(
            self.session.scalar(
                select(exists().where(Job.bundle_sha256 == sha256).where(Job.owner == owner))
            )
        )
