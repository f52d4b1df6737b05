"""Run Alembic migrations from code (used by `greenflow db upgrade` and the tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from scheduler_service.db.session import make_engine, normalise_url

REPO_ROOT = Path(__file__).resolve().parents[2]


def alembic_config(database_url: str) -> Config:
    """An Alembic config for our migrations directory and this database."""
    config = Config(str(REPO_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    config.attributes["database_url"] = normalise_url(database_url)
    config.attributes["configure_logging"] = False
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision`."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    """Revert migrations down to `revision`."""
    command.downgrade(alembic_config(database_url), revision)


def head_revisions() -> tuple[str, ...]:
    """The head revision(s) of the migration scripts (one, unless branches diverged)."""
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return tuple(script.get_heads())


def current_revision(database_url: str) -> str | None:
    """The revision the database is at (None when never migrated)."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
