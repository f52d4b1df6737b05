"""Several scheduler replicas on one PostgreSQL: exactly one holds the control-loop lock."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from scheduler_service.db.session import make_engine
from scheduler_service.leader import LOOP_LOCK_KEY, LeaderLock


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


@pytest.mark.postgres
def test_the_leader_holds_its_lock_without_an_open_transaction(postgres_server: str) -> None:
    engine, observer = make_engine(postgres_server), make_engine(postgres_server)
    lock = LeaderLock(engine)
    try:
        assert lock.try_acquire()
        assert lock.try_acquire()  # the liveness check runs no transaction either
        assert lock._conn is not None
        # Only this lock's own session: other servers on the shared test database may hold theirs.
        pid = lock._conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with observer.connect() as conn:
            states = conn.execute(
                text(
                    "SELECT a.state FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE l.locktype = 'advisory' AND l.objid = :low AND l.pid = :pid"
                ),
                {"low": LOOP_LOCK_KEY & 0xFFFF_FFFF, "pid": pid},
            ).scalars()
            assert list(states) == ["idle"]
    finally:
        lock.release()
        engine.dispose()
        observer.dispose()


def test_sqlite_needs_no_lock() -> None:
    engine = make_engine("sqlite://")
    try:
        assert LeaderLock(engine).try_acquire()
    finally:
        engine.dispose()
