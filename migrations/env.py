"""Alembic environment: the URL comes from the service settings, batch mode keeps SQLite in step."""

from __future__ import annotations

from logging.config import fileConfig
from typing import Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy.engine import Connection

from scheduler_service.db import models  # noqa: F401  (registers the tables)
from scheduler_service.db.base import Base, UTCDateTime
from scheduler_service.db.session import make_engine, normalise_url
from scheduler_service.settings import Settings

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _render_item(type_: str, obj: object, autogen_context: AutogenContext) -> str | Literal[False]:
    """Render our UTC column type as a plain timezone-aware DateTime so migrations stand alone."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _url() -> str:
    return normalise_url(config.attributes.get("database_url") or Settings().database_url)


def run_migrations_offline() -> None:
    """Emit SQL without a connection."""
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run against a live connection."""
    url = _url()
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection, url)
        return
    engine = make_engine(url)
    with engine.connect() as conn:
        if url.startswith("sqlite"):
            _run_sqlite(conn, url)
        else:
            _run(conn, url)
    engine.dispose()


def _run_sqlite(connection: Connection, url: str) -> None:
    """Migrate with foreign keys off, then check them: SQLite's batch operations rebuild a table
    (copy, drop, rename), and with foreign keys on, dropping the old table fired the children's
    ON DELETE CASCADE / SET NULL (a downgrade through a `nodes` rebuild emptied gpu_slots)."""
    # Outside any transaction: SQLite ignores this pragma inside one.
    connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    connection.commit()  # end SQLAlchemy's autobegun transaction: the migration opens its own
    try:
        _run(connection, url)
        broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        if broken:
            raise RuntimeError(f"the migration left rows with broken foreign keys: {broken[:5]}")
    finally:
        connection.rollback()
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")
        connection.commit()


def _run(connection: object, url: str) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        render_as_batch=url.startswith("sqlite"),
        compare_type=True,
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
