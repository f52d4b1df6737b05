"""Fixtures for the service tests: migrated databases (SQLite and PostgreSQL), apps, tokens."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from scheduler_service.app import create_app
from scheduler_service.auth.service import create_token
from scheduler_service.auth.tokens import Role
from scheduler_service.db import migrate
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.settings import GreenflowConfig, Settings

POSTGRES_URL = os.environ.get(
    "GREENFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _postgres_reachable() -> bool:
    try:
        engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The PostgreSQL admin URL; skips when no server answers."""
    if not _postgres_reachable():
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_URL}")
    return POSTGRES_URL


def fresh_postgres_database(admin_url: str) -> tuple[str, object]:
    """Create an empty database for one test (isolated from parallel runs); return URL and dropper."""
    name = f"greenflow_t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return url, drop


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each backend, migrated to head with Alembic."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'greenflow.db'}"
        migrate.upgrade(url)
        yield url
        return
    admin_url = request.getfixturevalue("postgres_server")
    url, drop = fresh_postgres_database(admin_url)
    try:
        migrate.upgrade(url)
        yield url
    finally:
        drop()  # type: ignore[operator]


@dataclass
class Tokens:
    """Plaintext tokens of the test principals."""

    operator: str
    alice: str
    bob: str
    agent: str


def make_tokens(url: str) -> Tokens:
    """Create an operator, two users and an agent in the database at `url`."""
    engine = make_engine(url)
    with transaction(make_session_factory(engine)) as session:
        tokens = Tokens(
            operator=create_token(session, name="ops", role=Role.OPERATOR),
            alice=create_token(session, name="alice", role=Role.USER),
            bob=create_token(session, name="bob", role=Role.USER),
            agent=create_token(session, name="node-1", role=Role.AGENT),
        )
    engine.dispose()
    return tokens


@pytest.fixture
def tokens(database_url: str) -> Tokens:
    """Tokens for the test principals."""
    return make_tokens(database_url)


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    """The app on the migrated database, without the control loop."""
    settings = Settings(database_url=database_url, run_control_loop=False)
    app = create_app(settings, GreenflowConfig())
    with TestClient(app) as test_client:
        yield test_client
    app.state.engine.dispose()


def auth(token: str) -> dict[str, str]:
    """The Authorization header for a token."""
    return {"Authorization": f"Bearer {token}"}
