"""Several scheduler replicas on one PostgreSQL: exactly one holds the control-loop lock."""

from __future__ import annotations

import pytest

from scheduler_service.db.session import make_engine
from scheduler_service.leader import LeaderLock


@pytest.mark.postgres
def test_only_one_replica_leads_and_leadership_moves_on_release(postgres_server: str) -> None:
    first_engine, second_engine = make_engine(postgres_server), make_engine(postgres_server)
    first, second = LeaderLock(first_engine), LeaderLock(second_engine)
    try:
        assert first.try_acquire()
        assert not second.try_acquire()
        assert first.try_acquire()  # still ours
        first.release()  # a replica that stops (or dies: its session ends) frees the lock
        assert second.try_acquire()
        assert not first.try_acquire()
    finally:
        first.release()
        second.release()
        first_engine.dispose()
        second_engine.dispose()


def test_sqlite_needs_no_lock() -> None:
    engine = make_engine("sqlite://")
    try:
        assert LeaderLock(engine).try_acquire()
    finally:
        engine.dispose()
