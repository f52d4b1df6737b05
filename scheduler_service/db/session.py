"""Engine and session factory for SQLite (embedded default) and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

T = TypeVar("T")


def normalise_url(url: str) -> str:
    """Use psycopg 3 for plain `postgresql://` URLs."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str) -> Engine:
    """Create an engine with the pragmas and pool settings each backend needs."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            # WAL lets the API read while the control loop writes.
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    # Bounded waits: while the database is away a request fails in seconds (503), not minutes.
    # No pre-ping (a round trip per checkout): a connection found dead fails its request (503)
    # and invalidates the pool, so the connections opened before the outage are all replaced.
    return create_engine(
        url,
        pool_pre_ping=False,
        pool_size=10,
        max_overflow=20,
        pool_timeout=10,
        connect_args={"connect_timeout": 5},
    )


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """A session factory whose objects stay readable after commit."""
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A unit of work: commit on success, roll back on error (for loops and CLI commands)."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def run_in_transaction(
    factory: sessionmaker[Session],
    work: Callable[[Session], T],
    attempts: int = 3,
    also_retry: tuple[type[Exception], ...] = (),
) -> T:
    """Run `work` in its own transaction, again from scratch if a concurrent update made it stale
    (or raised one of `also_retry`, such as a unique key a concurrent request inserted first)."""
    for attempt in Retrying(
        stop=stop_after_attempt(attempts),
        retry=retry_if_exception_type((StaleDataError, *also_retry)),
        reraise=True,
    ):
        with attempt, transaction(factory) as session:
            return work(session)
    raise AssertionError("unreachable: tenacity reraises the last error")
