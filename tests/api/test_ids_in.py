"""`ids_in`: `column IN ids` as one array parameter on PostgreSQL, a plain IN on SQLite, the
same rows on both (empty lists included)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.dialects import postgresql

from scheduler_service.db.base import utcnow
from scheduler_service.db.ids import ids_in
from scheduler_service.db.models import Job
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from tests.api.conftest import database_url, postgres_server  # noqa: F401


def test_a_long_id_list_is_one_parameter_on_postgresql() -> None:
    compiled = (
        select(Job.id).where(ids_in(Job.id, range(5000))).compile(dialect=postgresql.dialect())
    )
    assert "= ANY (" in str(compiled) and len(compiled.params) == 1


def test_ids_in_selects_the_same_rows_on_every_backend(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()
    try:
        with transaction(factory) as session:
            jobs = [
                Job(
                    owner="alice",
                    name=f"j{i}",
                    workload="mlp",
                    global_batch_size=16,
                    total_samples=100,
                    min_gpus=1,
                    max_gpus=1,
                    state="QUEUED",
                    state_reason="",
                    created_at=now,
                    updated_at=now,
                )
                for i in range(5)
            ]
            session.add_all(jobs)
            session.flush()
            ids = [j.id for j in jobs]
        with transaction(factory) as session:
            wanted = [ids[0], ids[3], ids[4], 10**9]
            found = session.scalars(select(Job.id).where(ids_in(Job.id, wanted)).order_by(Job.id))
            assert list(found) == [ids[0], ids[3], ids[4]]
            assert list(session.scalars(select(Job.id).where(ids_in(Job.id, [])))) == []
    finally:
        engine.dispose()
