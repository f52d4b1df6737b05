"""A submission writes its job once (inserted QUEUED, no second write) with its two events."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import event

from tests.api.conftest import Tokens, auth
from tests.api.test_jobs_api import spec


def test_a_submission_inserts_the_queued_job_and_its_events_and_updates_nothing(
    client: TestClient, tokens: Tokens
) -> None:
    engine = client.app.state.engine  # type: ignore[attr-defined]
    assert client.get("/v1/jobs", headers=auth(tokens.alice)).status_code == 200  # token cached
    statements: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        statements.append(" ".join(statement.split()[:3]).upper())

    event.listen(engine, "before_cursor_execute", record)
    try:
        response = client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice))
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["state"] == "QUEUED"
    writes = [s for s in statements if s.split()[0] in ("INSERT", "UPDATE", "DELETE")]
    assert [w for w in writes if w.startswith("INSERT INTO JOBS")] == ["INSERT INTO JOBS"]
    assert not [w for w in writes if w.startswith(("UPDATE", "DELETE"))], writes
    # The two events share one column set: one INSERT statement for both (a multi-row INSERT on
    # PostgreSQL, one executemany on SQLite).
    events_inserts = [w for w in writes if w.startswith("INSERT INTO JOB_EVENTS")]
    assert len(events_inserts) == 1, writes
    # No token lookup (cached), no re-read of the job: nothing but the writes.
    assert all(s.split()[0] in ("INSERT", "UPDATE", "DELETE") for s in statements), statements
    events = client.get(f"/v1/jobs/{job['id']}/events", headers=auth(tokens.alice)).json()
    assert [(e["from_state"], e["to_state"]) for e in events] == [
        (None, "PENDING"),
        ("PENDING", "QUEUED"),
    ]


def test_a_new_submission_id_is_not_looked_up_first_and_a_repeat_finds_its_job(
    client: TestClient, tokens: Tokens
) -> None:
    engine = client.app.state.engine  # type: ignore[attr-defined]
    assert client.get("/v1/jobs", headers=auth(tokens.alice)).status_code == 200  # token cached
    body = spec(submission_id="run-42")
    statements: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        statements.append(statement.split()[0].upper())

    event.listen(engine, "before_cursor_execute", record)
    try:
        first = client.post("/v1/jobs", json=body, headers=auth(tokens.alice))
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert first.status_code == 201
    assert "SELECT" not in statements, statements
    again = client.post("/v1/jobs", json=body, headers=auth(tokens.alice))
    assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])
    other = client.post("/v1/jobs", json={**body, "name": "else"}, headers=auth(tokens.alice))
    assert other.status_code == 409
