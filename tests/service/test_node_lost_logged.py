"""A node marked lost for its heartbeats is named in the server's log (at load nodes flapped
lost and re-registered with nothing in the log to say so)."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest

from scheduler_service.db.base import utcnow
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.nodes.service import mark_lost_nodes
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.support.rows import add_node


def test_a_node_marked_lost_is_logged_with_its_silence(
    database_url: str,  # noqa: F811 (fixture)
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()
    try:
        with transaction(factory) as session:
            add_node(
                session, "quiet", 2, state="ready", last_heartbeat_at=now - timedelta(minutes=2)
            )
            add_node(session, "alive", 2, state="ready", last_heartbeat_at=now)
        with (
            caplog.at_level(logging.WARNING, logger="greenflow.nodes"),
            transaction(factory) as session,
        ):
            lost = mark_lost_nodes(session, timeout_s=60, now=now)
        assert [n.name for n in lost] == ["quiet"]
        messages = [r.getMessage() for r in caplog.records if r.name == "greenflow.nodes"]
        assert len(messages) == 1
        assert messages[0].startswith("node quiet lost: no heartbeat for 60 s (last at ")
    finally:
        engine.dispose()
