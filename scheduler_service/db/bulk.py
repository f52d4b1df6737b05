"""Many rows in one statement: one array parameter per column, unnested, on PostgreSQL.

An executemany sends one statement per row (psycopg pipelines them): after a burst of 5,000
submissions the tick deferred 5,000 jobs, added their 5,000 events and stored 5,000 plan rows
that way, about 30 us of client CPU per row. `unnest` turns column arrays into rows on the
server: one statement and one parameter per column whatever the row count. SQLite has no
arrays; callers keep the executemany there (`on_postgresql`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, column, func
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session
from sqlalchemy.sql.selectable import TableValuedAlias
from sqlalchemy.types import TypeEngine


def on_postgresql(session: Session) -> bool:
    """Whether the session's database is PostgreSQL (the array statements run only there)."""
    return session.get_bind().dialect.name == "postgresql"


def unnested(
    name: str, columns: Sequence[tuple[str, TypeEngine[Any], Sequence[Any]]]
) -> TableValuedAlias:
    """`unnest(:a, :b, ...) AS name(a, b, ...)`: rows from equally long columns, each given as
    (column name, element type, values), to select or update from (PostgreSQL only)."""
    lengths = {len(values) for _, _, values in columns}
    if len(lengths) > 1:
        raise ValueError(f"columns of unequal length: {sorted(lengths)}")
    arrays = [bindparam(None, list(values), type_=ARRAY(kind)) for _, kind, values in columns]
    return (
        func.unnest(*arrays)
        .table_valued(*(column(label, kind) for label, kind, _ in columns))
        .render_derived(name=name)
    )
