"""The ledger's charge of job telemetry finds the uncharged samples by a flag on the samples, not
by testing every sample against every ledger entry: each sample is charged once across charge
cycles, and the read does not touch the ledger however long its history."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import event, func, select, text
from sqlalchemy.engine import Engine

from scheduler_service.budget.ledger import charge_new_telemetry
from scheduler_service.db.models import Job, LedgerEntry, TelemetrySample
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.settings import GreenflowConfig
from scheduler_service.telemetry.repository import TelemetryRepository, uncharged_query
from tests.api.conftest import database_url  # noqa: F401 (fixture)
from tests.support.rows import add_node

NOW = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


@contextmanager
def _statements(engine: Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(args[2])

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def _sample(job_id: int, node_id: int, k: int, energy_kwh: float) -> TelemetrySample:
    return TelemetrySample(
        sample_id=f"s-{job_id}-{k}",
        job_id=job_id,
        node_id=node_id,
        at=NOW + timedelta(seconds=5 * k),
        interval_s=5.0,
        step=k,
        samples_done=10 * k,
        samples_per_s=2.0,
        gpus=1,
        power_w=300.0,
        energy_kwh=energy_kwh,
        power_source="nvml",
    )


def test_each_sample_is_charged_once_across_cycles_and_the_read_skips_the_ledger(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = GreenflowConfig()
    with transaction(factory) as session:
        node_id = add_node(session, "n1", 1).id
        job = Job(
            owner="alice",
            name="j",
            workload="gpt2",
            global_batch_size=8,
            total_samples=10**9,
            min_gpus=1,
            max_gpus=1,
            state="RUNNING",
            state_reason="running",
            created_at=NOW,
            updated_at=NOW,
        )
        session.add(job)
        session.flush()
        job_id = job.id

    def add(first: int, count: int, energy_kwh: float = 0.000_4) -> None:
        with transaction(factory) as session:
            session.add_all(
                _sample(job_id, node_id, k, energy_kwh) for k in range(first, first + count)
            )

    def charge() -> tuple[int, list[str]]:
        with _statements(engine) as seen, transaction(factory) as session:
            charged = charge_new_telemetry(session, config)
        return charged.samples, seen

    def ledger() -> tuple[int, list[int | None]]:
        with transaction(factory) as session:
            entries = session.scalar(select(func.count()).select_from(LedgerEntry)) or 0
            ids = list(
                session.scalars(
                    select(LedgerEntry.telemetry_sample_id)
                    .where(LedgerEntry.telemetry_sample_id.is_not(None))
                    .order_by(LedgerEntry.telemetry_sample_id)
                )
            )
        return entries, ids

    try:
        add(0, 5)
        add(5, 2, energy_kwh=0.0)  # no energy: nothing to charge, ever
        first, seen = charge()
        assert first == 5
        entries, charged_ids = ledger()
        assert len(charged_ids) == 5 and entries >= 5
        # The read of what is left to charge names no ledger table: its cost is the backlog's.
        reads = [s for s in seen if "FROM telemetry_samples" in s]
        assert reads and not any("ledger_entries" in s for s in reads)

        # Nothing new: nothing charged again.
        assert charge()[0] == 0
        add(7, 3)
        assert charge()[0] == 3
        entries_after, charged_after = ledger()
        assert len(charged_after) == 8 == len(set(charged_after))
        assert charge()[0] == 0
        assert ledger() == (entries_after, charged_after)

        with transaction(factory) as session:
            flags = dict(session.execute(select(TelemetrySample.id, TelemetrySample.charged)).all())
            assert {i for i, c in flags.items() if c} == set(charged_after)
            assert TelemetryRepository(session).uncharged() == []
    finally:
        engine.dispose()


def test_the_uncharged_read_can_use_the_partial_index(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    """The query's predicate is the index's, so the database may answer from the index alone
    (asked with sequential scans off, where the tiny table would otherwise be scanned)."""
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    try:
        with transaction(factory) as session:
            sql = str(
                uncharged_query(5000).compile(
                    dialect=engine.dialect, compile_kwargs={"literal_binds": True}
                )
            )
            if engine.dialect.name == "postgresql":
                session.execute(text("SET LOCAL enable_seqscan = off"))
                plan = "\n".join(session.scalars(text(f"EXPLAIN {sql}")))
            else:
                plan = "\n".join(
                    str(row[-1]) for row in session.execute(text(f"EXPLAIN QUERY PLAN {sql}"))
                )
        assert "ix_telemetry_samples_uncharged" in plan, plan
    finally:
        engine.dispose()
