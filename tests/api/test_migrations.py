"""Alembic: one head, models and migrations agree, upgrade/downgrade with rows present."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from scheduler_service.db import migrate
from scheduler_service.db.base import Base
from scheduler_service.db.models import (
    Allocation,
    ApiToken,
    GpuSlot,
    Job,
    JobEvent,
    LedgerEntry,
    Node,
    TelemetrySample,
)
from scheduler_service.db.session import make_engine, make_session_factory, transaction


def test_single_head() -> None:
    assert len(migrate.head_revisions()) == 1


def test_models_and_migrations_agree(database_url: str) -> None:
    engine = make_engine(database_url)
    with engine.connect() as conn:
        diff = compare_metadata(
            MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
        )
    engine.dispose()
    assert diff == []


def _seed(database_url: str) -> None:
    now = datetime.now(UTC)
    engine = make_engine(database_url)
    with transaction(make_session_factory(engine)) as session:
        session.add(ApiToken(token_id="t1", secret_sha256="0" * 64, name="ops", role="operator"))
        job = Job(
            owner="alice",
            name="j",
            workload="gpt2",
            global_batch_size=8,
            total_samples=80,
            min_gpus=1,
            max_gpus=2,
            state="RUNNING",
            state_reason="x",
            created_at=now,
            updated_at=now,
        )
        node = Node(name="n1", agent_url="http://127.0.0.1:1")
        session.add_all([job, node])
        session.flush()
        session.add_all(
            [
                JobEvent(job_id=job.id, to_state="RUNNING", reason="test"),
                GpuSlot(node_id=node.id, index=0, job_id=job.id),
                Allocation(job_id=job.id, generation=1, node_id=node.id, gpus=1, slot_indices=[0]),
                TelemetrySample(
                    sample_id="s1",
                    job_id=job.id,
                    node_id=node.id,
                    at=now,
                    interval_s=5,
                    step=1,
                    samples_done=8,
                    samples_per_s=1.6,
                    gpus=1,
                    power_w=100,
                    energy_kwh=0.0001,
                    power_source="estimated",
                ),
                LedgerEntry(
                    job_id=job.id,
                    period_start=now,
                    period_end=now,
                    interval_start=now,
                    interval_end=now,
                    energy_kwh=0.0001,
                    pue=1.2,
                    intensity_g_per_kwh=300,
                    emissions_kg=0.0000036,
                ),
            ]
        )
    engine.dispose()


def test_upgrade_and_downgrade_with_rows_present(database_url: str) -> None:
    _seed(database_url)
    engine = make_engine(database_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 1
    migrate.downgrade(database_url, "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    migrate.upgrade(database_url)
    assert {"jobs", "job_events", "allocations", "ledger_entries"} <= set(
        inspect(engine).get_table_names()
    )
    engine.dispose()
    assert migrate.current_revision(database_url) == migrate.head_revisions()[0]


def test_timestamps_come_back_as_utc(database_url: str) -> None:
    _seed(database_url)
    engine = make_engine(database_url)
    with make_session_factory(engine)() as session:
        job = session.query(Job).one()
        assert job.created_at.tzinfo is not None
        assert job.created_at.utcoffset() == UTC.utcoffset(None)
    engine.dispose()


def test_plans_stored_before_plan_jobs_get_their_rows(database_url: str) -> None:
    migrate.downgrade(database_url, "4472019e3fbb")  # to before plan_jobs
    engine = make_engine(database_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO plans (created_at, start_at, slot_s, policy, status, solve_s,"
                " energy_kwh, emissions_kg, forecast_degraded, gpus_by_job, slots, deadline_misses)"
                " VALUES (:at, :at, 600, 'greenflow', 'OPTIMAL', 0.1, 1, 0.2, false, :gpus,"
                " :slots, :misses)"
            ),
            {
                "at": datetime.now(UTC),
                "gpus": '{"1": [2, 4, 0], "2": [1, 1, 1, 1]}',
                "slots": "[{}, {}, {}]",
                "misses": '{"2": "too little time", "7": "no GPUs"}',
            },
        )
    migrate.upgrade(database_url)
    with engine.connect() as conn:
        totals = conn.execute(text("SELECT num_slots, total_gpus FROM plans")).one()
        rows = conn.execute(
            text("SELECT job_id, gpus, deadline_miss FROM plan_jobs ORDER BY job_id")
        ).all()
    engine.dispose()
    assert totals[0] == 3
    total_gpus = json.loads(totals[1]) if isinstance(totals[1], str) else totals[1]
    assert total_gpus == [3, 5, 1, 1]
    parsed = [(j, json.loads(g) if isinstance(g, str) else g, m) for j, g, m in rows]
    assert parsed == [
        (1, [2, 4, 0], None),
        (2, [1, 1, 1, 1], "too little time"),
        (7, [], "no GPUs"),
    ]


def test_telemetry_charged_so_far_is_marked_by_the_upgrade(database_url: str) -> None:
    _seed(database_url)  # sample s1, which no ledger entry names
    migrate.downgrade(database_url, "d5f7a9b1c3e4")  # to before telemetry_samples.charged
    engine = make_engine(database_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO telemetry_samples (sample_id, job_id, node_id, at, interval_s, step,"
                " samples_done, samples_per_s, gpus, power_w, energy_kwh, power_source)"
                " SELECT 's2', job_id, node_id, at, interval_s, 2, 16, 1.6, 1, 100, 0.0001,"
                " 'estimated' FROM telemetry_samples WHERE sample_id = 's1'"
            )
        )
        conn.execute(
            text(
                "UPDATE ledger_entries SET telemetry_sample_id ="
                " (SELECT id FROM telemetry_samples WHERE sample_id = 's2')"
            )
        )
    migrate.upgrade(database_url)
    with engine.connect() as conn:
        flags: dict[str, object] = dict(
            conn.execute(text("SELECT sample_id, charged FROM telemetry_samples")).all()
        )
    engine.dispose()
    assert {k: bool(v) for k, v in flags.items()} == {"s1": False, "s2": True}


def _row_counts(database_url: str) -> dict[str, int]:
    engine = make_engine(database_url)
    with engine.connect() as conn:
        counts = {
            table: conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
            for table in ("jobs", "nodes", "gpu_slots", "allocations", "job_events")
        }
        counts["telemetry_on_a_node"] = conn.execute(
            text("SELECT count(*) FROM telemetry_samples WHERE node_id IS NOT NULL")
        ).scalar_one()
    engine.dispose()
    return counts


def test_downgrades_that_rebuild_a_parent_table_keep_its_childrens_rows(database_url: str) -> None:
    # SQLite rebuilds a table for a batch drop_column (copy, drop, rename): with foreign keys
    # on, dropping the old `nodes` fired ON DELETE CASCADE / SET NULL on gpu_slots, allocations
    # and telemetry_samples. Migrations run with foreign keys off and checked afterwards.
    _seed(database_url)
    before = _row_counts(database_url)
    assert before["gpu_slots"] == 1 and before["telemetry_on_a_node"] == 1
    migrate.downgrade(database_url, "c4e6a8b0d2f3")  # below d5f7a9b1c3e4's nodes column
    assert _row_counts(database_url) == before
    migrate.upgrade(database_url)
    assert _row_counts(database_url) == before
