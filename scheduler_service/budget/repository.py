"""Queries on ledger_entries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, func, insert, select
from sqlalchemy.orm import Session

from scheduler_service.db.models import Job, LedgerEntry

# Every column an entry may leave out: an executemany needs the same keys in every row.
_ENTRY_DEFAULTS: dict[str, Any] = {
    "job_id": None,
    "telemetry_sample_id": None,
    "component": "gpu",
    "power_source": "unknown",
    "node_id": None,
    "node_power_sample_id": None,
    "intensity_source": "",
}


@dataclass(frozen=True)
class ReportRow:
    """Ledger sums of one (job, component, power source, intensity source) group."""

    job_id: int | None
    queue: str | None
    owner: str | None
    component: str
    power_source: str
    intensity_source: str
    energy_kwh: float
    pue_overhead_kwh: float
    emissions_kg: float


class LedgerRepository:
    """All SQL touching ledger_entries."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._staged: list[dict[str, Any]] = []

    def stage(self, values: Mapping[str, Any]) -> None:
        """Stage a ledger entry's column values (written by `insert_staged`)."""
        self._staged.append({**_ENTRY_DEFAULTS, **values})

    def insert_staged(self) -> None:
        """Insert the staged entries in one executemany, no ORM object: a tick charges every
        sample since the last charge (hundreds with a few hundred jobs running), and an ORM
        object and flush per entry cost about 0.4 ms each."""
        if self._staged:
            self.session.execute(insert(cast(Table, LedgerEntry.__table__)), self._staged)
            self._staged = []

    def period_sums(
        self, start_at: datetime, end_at: datetime, queues: list[str] | None = None
    ) -> tuple[float, float]:
        """(kg, facility kWh) charged to the periods starting in [start_at, end_at) (a period
        keyed by another time zone's midnight still counts), only `queues`' jobs when given."""
        stmt = select(
            func.coalesce(func.sum(LedgerEntry.emissions_kg), 0.0),
            func.coalesce(func.sum(LedgerEntry.energy_kwh * LedgerEntry.pue), 0.0),
        ).where(LedgerEntry.period_start >= start_at, LedgerEntry.period_start < end_at)
        if queues is not None:
            stmt = stmt.join(Job, Job.id == LedgerEntry.job_id).where(Job.queue.in_(queues))
        row = self.session.execute(stmt).one()
        return float(row[0] or 0.0), float(row[1] or 0.0)

    def totals(self) -> tuple[float, float]:
        """(IT energy kWh, emissions kg) over the whole ledger."""
        row = self.session.execute(
            select(
                func.coalesce(func.sum(LedgerEntry.energy_kwh), 0.0),
                func.coalesce(func.sum(LedgerEntry.emissions_kg), 0.0),
            )
        ).one()
        return float(row[0]), float(row[1])

    def report_rows(
        self, start_at: datetime, end_at: datetime, owner: str | None = None
    ) -> list[ReportRow]:
        """Ledger sums per job, component, power source and intensity source for the entries
        whose interval starts in [start_at, end_at) (only `owner`'s jobs when given)."""
        stmt = (
            select(
                LedgerEntry.job_id,
                Job.queue,
                Job.owner,
                LedgerEntry.component,
                LedgerEntry.power_source,
                LedgerEntry.intensity_source,
                func.sum(LedgerEntry.energy_kwh),
                func.sum(LedgerEntry.energy_kwh * (LedgerEntry.pue - 1.0)),
                func.sum(LedgerEntry.emissions_kg),
            )
            .outerjoin(Job, Job.id == LedgerEntry.job_id)
            .where(LedgerEntry.interval_start >= start_at, LedgerEntry.interval_start < end_at)
            .group_by(
                LedgerEntry.job_id,
                Job.queue,
                Job.owner,
                LedgerEntry.component,
                LedgerEntry.power_source,
                LedgerEntry.intensity_source,
            )
        )
        if owner is not None:
            stmt = stmt.where(Job.owner == owner)
        return [
            ReportRow(
                job_id=row[0],
                queue=row[1],
                owner=row[2],
                component=row[3],
                power_source=row[4],
                intensity_source=row[5],
                energy_kwh=float(row[6] or 0.0),
                pue_overhead_kwh=float(row[7] or 0.0),
                emissions_kg=float(row[8] or 0.0),
            )
            for row in self.session.execute(stmt)
        ]

    def totals_by_component(
        self, start_at: datetime, end_at: datetime, queues: list[str] | None = None
    ) -> list[tuple[str, float, float]]:
        """(component, facility kWh, kg) charged to the periods starting in [start_at, end_at)
        (only `queues`' jobs when given)."""
        stmt = (
            select(
                LedgerEntry.component,
                func.sum(LedgerEntry.energy_kwh * LedgerEntry.pue),
                func.sum(LedgerEntry.emissions_kg),
            )
            .where(LedgerEntry.period_start >= start_at, LedgerEntry.period_start < end_at)
            .group_by(LedgerEntry.component)
        )
        if queues is not None:
            stmt = stmt.join(Job, Job.id == LedgerEntry.job_id).where(Job.queue.in_(queues))
        rows = self.session.execute(stmt)
        return [(str(c), float(e or 0.0), float(k or 0.0)) for c, e, k in rows]

    def all_time_by_component(self) -> list[tuple[str, float, float]]:
        """(component, facility kWh, kg) over the whole ledger."""
        rows = self.session.execute(
            select(
                LedgerEntry.component,
                func.sum(LedgerEntry.energy_kwh * LedgerEntry.pue),
                func.sum(LedgerEntry.emissions_kg),
            ).group_by(LedgerEntry.component)
        )
        return [(str(c), float(e or 0.0), float(k or 0.0)) for c, e, k in rows]

    def queues_of_owner(self, owner: str) -> set[str]:
        """The queues `owner` has submitted jobs to."""
        return set(self.session.scalars(select(Job.queue).where(Job.owner == owner).distinct()))
