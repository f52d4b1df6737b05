"""Queries on telemetry_samples."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from sqlalchemy import Select, func, literal_column, select, update
from sqlalchemy.orm import InstrumentedAttribute, Session, selectinload

from scheduler_service.db.ids import ids_in
from scheduler_service.db.models import (
    Allocation,
    GpuSlot,
    NodePowerReading,
    NodePowerSampleRow,
    TelemetrySample,
)


def _stored_ids(session: Session, column: InstrumentedAttribute[str], ids: list[str]) -> set[str]:
    """Which of `ids` the table of `column` holds already (one query; none for no ids)."""
    if not ids:
        return set()
    return set(session.scalars(select(column).where(column.in_(ids))))


def uncharged_query(limit: int) -> Select[TelemetrySample]:
    """The oldest `limit` samples with energy the ledger has not charged yet."""
    # The predicate is the partial index's (ix_telemetry_samples_uncharged): the read costs the
    # backlog, not the history. SQLite uses a partial index only for the same terms written
    # alike: `NOT charged` (its `charged = 0`) and a literal 0, not a bound parameter.
    return (
        select(TelemetrySample)
        .where(~TelemetrySample.charged, TelemetrySample.energy_kwh > literal_column("0"))
        .order_by(TelemetrySample.id)
        .limit(limit)
    )


class TelemetryRepository:
    """All SQL touching telemetry_samples."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def known_sample_ids(self, sample_ids: list[str]) -> set[str]:
        """Which of these agent-chosen ids are stored already."""
        return _stored_ids(self.session, TelemetrySample.sample_id, sample_ids)

    def last_end_from(self, job_id: int, node_id: int) -> datetime | None:
        """When the newest stored sample of this job from this node ended."""
        return self.session.scalar(
            select(func.max(TelemetrySample.at)).where(
                TelemetrySample.job_id == job_id, TelemetrySample.node_id == node_id
            )
        )

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

    def newest_of_jobs(
        self, job_ids: Sequence[int], *, limit: int
    ) -> dict[int, list[TelemetrySample]]:
        """The newest `limit` samples of each job, in time order, in one query."""
        if not job_ids:
            return {}
        rank = (
            func.row_number()
            .over(
                partition_by=TelemetrySample.job_id,
                order_by=(TelemetrySample.at.desc(), TelemetrySample.id.desc()),
            )
            .label("rank")
        )
        ranked = (
            select(TelemetrySample.id, rank)
            .where(ids_in(TelemetrySample.job_id, job_ids))
            .subquery()
        )
        stmt = (
            select(TelemetrySample)
            .join(ranked, ranked.c.id == TelemetrySample.id)
            .where(ranked.c.rank <= limit)
            .order_by(TelemetrySample.job_id, TelemetrySample.at, TelemetrySample.id)
        )
        return _by_job(self.session.scalars(stmt))

    def of_jobs_after(
        self, job_ids: Sequence[int], after_id: int
    ) -> dict[int, list[TelemetrySample]]:
        """Samples of these jobs stored after sample id `after_id`, in time order, in one query."""
        if not job_ids:
            return {}
        stmt = (
            select(TelemetrySample)
            .where(ids_in(TelemetrySample.job_id, job_ids), TelemetrySample.id > after_id)
            .order_by(TelemetrySample.job_id, TelemetrySample.at, TelemetrySample.id)
        )
        return _by_job(self.session.scalars(stmt))

    def newest_id(self) -> int:
        """The highest sample id stored (0 with none)."""
        return self.session.scalar(select(func.max(TelemetrySample.id))) or 0

    def uncharged(self, *, limit: int = 5000) -> list[TelemetrySample]:
        """Samples with energy the ledger has not charged yet, oldest first."""
        return list(self.session.scalars(uncharged_query(limit)))

    def mark_charged(self, sample_ids: Sequence[int]) -> None:
        """Mark these samples charged, in one statement (none for no ids)."""
        if not sample_ids:
            return
        self.session.execute(
            update(TelemetrySample)
            .where(ids_in(TelemetrySample.id, sample_ids))
            .values(charged=True)
            .execution_options(synchronize_session=False)
        )


class NodePowerRepository:
    """All SQL touching node_power_samples and node_power_readings."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def known_sample_ids(self, sample_ids: list[str]) -> set[str]:
        """Which of these agent-chosen ids are stored already."""
        return _stored_ids(self.session, NodePowerSampleRow.sample_id, sample_ids)

    def last_end(self, node_id: int) -> datetime | None:
        """When the node's newest stored power sample ended."""
        return self.session.scalar(
            select(func.max(NodePowerSampleRow.at)).where(NodePowerSampleRow.node_id == node_id)
        )

    def placed_job_ids(self, node_id: int, job_ids: set[int]) -> set[int]:
        """Which of these jobs have ever been allocated to the node, or hold slots on it now (a
        job across nodes, whose commands go to its runner's node)."""
        if not job_ids:
            return set()
        rows = self.session.scalars(
            select(Allocation.job_id)
            .where(Allocation.node_id == node_id, Allocation.job_id.in_(job_ids))
            .union(
                select(GpuSlot.job_id).where(
                    GpuSlot.node_id == node_id, GpuSlot.job_id.in_(job_ids)
                )
            )
        )
        return {int(j) for j in rows if j is not None}

    def add(self, sample: NodePowerSampleRow) -> None:
        """Stage a sample with its readings."""
        self.session.add(sample)

    def uncharged(self, *, limit: int = 2000) -> list[NodePowerSampleRow]:
        """Samples the ledger has not charged yet, oldest first, with their readings."""
        stmt = (
            select(NodePowerSampleRow)
            .where(NodePowerSampleRow.charged.is_(False))
            .options(selectinload(NodePowerSampleRow.readings))
            .order_by(NodePowerSampleRow.id)
            .limit(limit)
        )
        return list(self.session.scalars(stmt))

    def overhead_power_w(self, now: datetime, window_s: float) -> float:
        """Average idle-GPU and host watts of the cluster over the `window_s` before `now`: per
        node, its overhead energy over the time its samples cover, summed over nodes."""
        since = now - timedelta(seconds=window_s)
        covered = dict(
            self.session.execute(
                select(NodePowerSampleRow.node_id, func.sum(NodePowerSampleRow.interval_s))
                .where(NodePowerSampleRow.at > since, NodePowerSampleRow.at <= now)
                .group_by(NodePowerSampleRow.node_id)
            ).all()
        )
        energy = self.session.execute(
            select(NodePowerSampleRow.node_id, func.sum(NodePowerReading.energy_j))
            .join(NodePowerReading, NodePowerReading.sample_id == NodePowerSampleRow.id)
            .where(
                NodePowerSampleRow.at > since,
                NodePowerSampleRow.at <= now,
                (NodePowerReading.component == "host") | NodePowerReading.job_id.is_(None),
            )
            .group_by(NodePowerSampleRow.node_id)
        ).all()
        return sum(
            float(joules or 0.0) / float(covered[node_id])
            for node_id, joules in energy
            if covered.get(node_id)
        )


def _by_job(rows: Iterable[TelemetrySample]) -> dict[int, list[TelemetrySample]]:
    out: dict[int, list[TelemetrySample]] = {}
    for row in rows:
        out.setdefault(row.job_id, []).append(row)
    return out
