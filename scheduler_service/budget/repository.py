"""Queries on ledger_entries."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from scheduler_service.db.models import LedgerEntry


class LedgerRepository:
    """All SQL touching ledger_entries."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, entry: LedgerEntry) -> None:
        """Stage a ledger entry."""
        self.session.add(entry)

    def spent_kg(self, period_start: datetime) -> float:
        """Emissions charged to the period that starts at `period_start`."""
        total = self.session.scalar(
            select(func.coalesce(func.sum(LedgerEntry.emissions_kg), 0.0)).where(
                LedgerEntry.period_start == period_start
            )
        )
        return float(total or 0.0)

    def energy_kwh(self, period_start: datetime) -> float:
        """Facility energy charged to the period that starts at `period_start`."""
        total = self.session.scalar(
            select(func.coalesce(func.sum(LedgerEntry.energy_kwh * LedgerEntry.pue), 0.0)).where(
                LedgerEntry.period_start == period_start
            )
        )
        return float(total or 0.0)

    def totals(self) -> tuple[float, float]:
        """(IT energy kWh, emissions kg) over the whole ledger."""
        row = self.session.execute(
            select(
                func.coalesce(func.sum(LedgerEntry.energy_kwh), 0.0),
                func.coalesce(func.sum(LedgerEntry.emissions_kg), 0.0),
            )
        ).one()
        return float(row[0]), float(row[1])
