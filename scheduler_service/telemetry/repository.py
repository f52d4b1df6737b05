"""Queries on telemetry_samples."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler_service.db.models import LedgerEntry, TelemetrySample


class TelemetryRepository:
    """All SQL touching telemetry_samples."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def known_sample_ids(self, sample_ids: list[str]) -> set[str]:
        """Which of these agent-chosen ids are stored already."""
        if not sample_ids:
            return set()
        rows = self.session.scalars(
            select(TelemetrySample.sample_id).where(TelemetrySample.sample_id.in_(sample_ids))
        )
        return set(rows)

    def add(self, sample: TelemetrySample) -> None:
        """Stage a sample."""
        self.session.add(sample)

    def for_job(
        self, job_id: int, *, since: datetime | None = None, limit: int = 1000
    ) -> list[TelemetrySample]:
        """A job's samples in time order (the newest `limit`)."""
        stmt = select(TelemetrySample).where(TelemetrySample.job_id == job_id)
        if since is not None:
            stmt = stmt.where(TelemetrySample.at >= since)
        rows = list(
            self.session.scalars(
                stmt.order_by(TelemetrySample.at.desc(), TelemetrySample.id.desc()).limit(limit)
            )
        )
        rows.reverse()
        return rows

    def uncharged(self, *, limit: int = 5000) -> list[TelemetrySample]:
        """Samples with energy that no ledger entry has charged yet, oldest first."""
        charged = select(LedgerEntry.telemetry_sample_id).where(
            LedgerEntry.telemetry_sample_id.is_not(None)
        )
        stmt = (
            select(TelemetrySample)
            .where(TelemetrySample.id.not_in(charged), TelemetrySample.energy_kwh > 0)
            .order_by(TelemetrySample.id)
            .limit(limit)
        )
        return list(self.session.scalars(stmt))
