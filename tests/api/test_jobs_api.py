"""The jobs API on SQLite and PostgreSQL: submission, validation, visibility, cancel, events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import Tokens, auth


def spec(**overrides: Any) -> dict[str, Any]:
    """A valid job spec with some fields replaced."""
    base: dict[str, Any] = {
        "name": "train-gpt",
        "workload": "gpt2",
        "global_batch_size": 64,
        "total_samples": 64_000,
        "min_gpus": 1,
        "max_gpus": 8,
    }
    base.update(overrides)
    return base


def register_node(client: TestClient, tokens: Tokens, gpus: int = 4) -> None:
    """Register a node with `gpus` slots, as an agent would."""
    body = {
        "name": "node-1",
        "agent_url": "http://127.0.0.1:9",
        "slots": [{"index": i} for i in range(gpus)],
    }
    response = client.post("/v1/nodes/register", json=body, headers=auth(tokens.agent))
    assert response.status_code == 200, response.text


def test_submit_returns_201_and_records_events(client: TestClient, tokens: Tokens) -> None:
    register_node(client, tokens)
    deadline = (datetime.now(UTC) + timedelta(hours=6)).isoformat()
    response = client.post(
        "/v1/jobs", json=spec(deadline=deadline, priority=3), headers=auth(tokens.alice)
    )
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["owner"] == "alice"
    assert job["state"] == "QUEUED"
    assert job["priority"] == 3
    assert datetime.fromisoformat(job["deadline"]) == datetime.fromisoformat(deadline)

    events = client.get(f"/v1/jobs/{job['id']}/events", headers=auth(tokens.alice)).json()
    assert [(e["from_state"], e["to_state"]) for e in events] == [
        (None, "PENDING"),
        ("PENDING", "QUEUED"),
    ]
    assert all(e["reason"] for e in events)


def test_resubmitting_the_same_submission_id_returns_the_existing_job(
    client: TestClient, tokens: Tokens
) -> None:
    first = client.post("/v1/jobs", json=spec(submission_id="run-42"), headers=auth(tokens.alice))
    again = client.post("/v1/jobs", json=spec(submission_id="run-42"), headers=auth(tokens.alice))
    assert first.status_code == 201
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    listing = client.get("/v1/jobs", headers=auth(tokens.alice)).json()
    assert listing["total"] == 1

    changed = client.post(
        "/v1/jobs", json=spec(submission_id="run-42", max_gpus=4), headers=auth(tokens.alice)
    )
    assert changed.status_code == 409
    assert "submission_id" in changed.json()["detail"]

    # Another user may use the same client-chosen id for their own job.
    other = client.post("/v1/jobs", json=spec(submission_id="run-42"), headers=auth(tokens.bob))
    assert other.status_code == 201
    assert other.json()["id"] != first.json()["id"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"min_gpus": 8, "max_gpus": 2}, "min_gpus"),
        ({"total_steps": 10}, "total_steps"),
        ({"total_samples": None}, "total_samples"),
        ({"workload": "no-such-model"}, "workload"),
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"deadline": "2030-01-01T00:00:00"}, "deadline"),
        ({"priority": 1000}, "priority"),
        ({"surprise": 1}, "surprise"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_specs_get_422_naming_the_field(
    client: TestClient, tokens: Tokens, overrides: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/jobs", json=spec(**overrides), headers=auth(tokens.alice))
    assert response.status_code == 422, response.text
    assert field in response.text
    assert client.get("/v1/jobs", headers=auth(tokens.alice)).json()["total"] == 0


def test_deadline_in_the_past_is_rejected_with_the_field(
    client: TestClient, tokens: Tokens
) -> None:
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    response = client.post("/v1/jobs", json=spec(deadline=past), headers=auth(tokens.alice))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "deadline"]


def test_total_steps_are_accepted_and_entrypoints_only_when_allowed(
    client: TestClient, tokens: Tokens
) -> None:
    body = spec(total_steps=500)
    del body["total_samples"]
    response = client.post("/v1/jobs", json=body, headers=auth(tokens.alice))
    assert response.status_code == 201, response.text
    assert response.json()["total_steps"] == 500
    # An entrypoint runs only where greenflow.toml allows it (none by default; test_hardening).
    body["workload"] = "my_pkg.train:main"
    response = client.post("/v1/jobs", json=body, headers=auth(tokens.alice))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "workload"]


def test_users_see_only_their_own_jobs(client: TestClient, tokens: Tokens) -> None:
    alice_job = client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice)).json()
    bob_job = client.post("/v1/jobs", json=spec(name="bob-job"), headers=auth(tokens.bob)).json()

    assert client.get(f"/v1/jobs/{bob_job['id']}", headers=auth(tokens.alice)).status_code == 404
    missing = client.get("/v1/jobs/999999", headers=auth(tokens.alice))
    # Someone else's job and a job that does not exist look the same.
    assert missing.status_code == 404
    assert (
        client.post(f"/v1/jobs/{bob_job['id']}/cancel", headers=auth(tokens.alice)).status_code
        == 404
    )
    assert (
        client.get(f"/v1/jobs/{bob_job['id']}/events", headers=auth(tokens.alice)).status_code
        == 404
    )

    mine = client.get("/v1/jobs", headers=auth(tokens.alice)).json()
    assert [j["id"] for j in mine["items"]] == [alice_job["id"]]
    assert client.get("/v1/jobs?owner=bob", headers=auth(tokens.alice)).status_code == 403

    everyone = client.get("/v1/jobs", headers=auth(tokens.operator)).json()
    assert {j["owner"] for j in everyone["items"]} == {"alice", "bob"}
    only_bob = client.get("/v1/jobs?owner=bob", headers=auth(tokens.operator)).json()
    assert [j["id"] for j in only_bob["items"]] == [bob_job["id"]]


def test_listing_filters_and_paginates(client: TestClient, tokens: Tokens) -> None:
    ids = [
        client.post("/v1/jobs", json=spec(name=f"j{i}"), headers=auth(tokens.alice)).json()["id"]
        for i in range(5)
    ]
    client.post(f"/v1/jobs/{ids[0]}/cancel", headers=auth(tokens.alice))
    page1 = client.get("/v1/jobs?limit=2&offset=0", headers=auth(tokens.alice)).json()
    page2 = client.get("/v1/jobs?limit=2&offset=2", headers=auth(tokens.alice)).json()
    assert page1["total"] == 5
    assert [j["id"] for j in page1["items"]] == ids[::-1][:2]
    assert [j["id"] for j in page2["items"]] == ids[::-1][2:4]
    cancelled = client.get("/v1/jobs?state=CANCELLED", headers=auth(tokens.alice)).json()
    assert [j["id"] for j in cancelled["items"]] == [ids[0]]
    assert client.get("/v1/jobs?state=NOPE", headers=auth(tokens.alice)).status_code == 422
    assert client.get("/v1/jobs?limit=0", headers=auth(tokens.alice)).status_code == 422


def test_query_typos_and_repeated_one_value_parameters_get_422_naming_them(
    client: TestClient, tokens: Tokens
) -> None:
    client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice))
    typo = client.get("/v1/jobs?stat=CANCELLED", headers=auth(tokens.alice))
    assert typo.status_code == 422
    assert typo.json()["detail"][0]["loc"] == ["query", "stat"]
    twice = client.get("/v1/jobs?limit=1&limit=50", headers=auth(tokens.alice))
    assert twice.status_code == 422
    assert twice.json()["detail"] == [
        {
            "loc": ["query", "limit"],
            "msg": "given 2 times; this parameter takes one value",
            "type": "too_many_values",
        }
    ]
    # A list parameter takes repeated values.
    both = client.get("/v1/jobs?state=QUEUED&state=PENDING", headers=auth(tokens.alice))
    assert both.status_code == 200, both.text
    assert both.json()["total"] == 1


def test_cancel_is_recorded_and_terminal_states_are_never_left(
    client: TestClient, tokens: Tokens
) -> None:
    job = client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice)).json()
    cancelled = client.post(
        f"/v1/jobs/{job['id']}/cancel", json={"reason": "wrong data"}, headers=auth(tokens.alice)
    )
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "CANCELLED"
    assert cancelled.json()["finished_at"] is not None
    # Repeating the cancel is harmless and records nothing new.
    assert (
        client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(tokens.alice)).status_code == 200
    )
    events = client.get(f"/v1/jobs/{job['id']}/events", headers=auth(tokens.alice)).json()
    assert events[-1]["to_state"] == "CANCELLED"
    assert events[-1]["reason"] == "wrong data"
    assert sum(1 for e in events if e["to_state"] == "CANCELLED") == 1


def test_operator_actions(client: TestClient, tokens: Tokens) -> None:
    job = client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice)).json()
    assert client.post(f"/v1/jobs/{job['id']}/hold", headers=auth(tokens.alice)).status_code == 403
    held = client.post(f"/v1/jobs/{job['id']}/hold", headers=auth(tokens.operator)).json()
    assert held["held"] is True
    released = client.post(f"/v1/jobs/{job['id']}/release", headers=auth(tokens.operator)).json()
    assert released["held"] is False
    bumped = client.post(
        f"/v1/jobs/{job['id']}/priority", json={"priority": 7}, headers=auth(tokens.operator)
    ).json()
    assert bumped["priority"] == 7
    kinds = [
        e["kind"]
        for e in client.get(f"/v1/jobs/{job['id']}/events", headers=auth(tokens.operator)).json()
    ]
    assert kinds[-3:] == ["hold", "release", "priority"]


def test_operators_change_the_gpus_a_job_may_use(client: TestClient, tokens: Tokens) -> None:
    job = client.post("/v1/jobs", json=spec(max_gpus=4), headers=auth(tokens.alice)).json()
    path = f"/v1/jobs/{job['id']}/gpus"
    assert (
        client.post(
            path, json={"min_gpus": 1, "max_gpus": 1}, headers=auth(tokens.alice)
        ).status_code
        == 403
    )
    bad = client.post(path, json={"min_gpus": 3, "max_gpus": 2}, headers=auth(tokens.operator))
    assert bad.status_code == 422 and "min_gpus (3) must not exceed max_gpus (2)" in bad.text
    zero = client.post(path, json={"min_gpus": 0, "max_gpus": 2}, headers=auth(tokens.operator))
    assert zero.status_code == 422 and "min_gpus" in zero.text
    changed = client.post(path, json={"min_gpus": 2, "max_gpus": 2}, headers=auth(tokens.operator))
    assert changed.status_code == 200
    assert (changed.json()["min_gpus"], changed.json()["max_gpus"]) == (2, 2)
    # The same range again records nothing new.
    client.post(path, json={"min_gpus": 2, "max_gpus": 2}, headers=auth(tokens.operator))
    events = client.get(f"/v1/jobs/{job['id']}/events", headers=auth(tokens.alice)).json()
    ranges = [e for e in events if e["kind"] == "gpu_range"]
    assert len(ranges) == 1 and ranges[0]["actor"] == "ops"
    assert ranges[0]["reason"] == "GPUs allowed 1-4 -> 2-2"
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(tokens.alice))
    done = client.post(path, json={"min_gpus": 1, "max_gpus": 1}, headers=auth(tokens.operator))
    assert done.status_code == 409
    missing = client.post(
        "/v1/jobs/999999/gpus", json={"min_gpus": 1, "max_gpus": 1}, headers=auth(tokens.operator)
    )
    assert missing.status_code == 404


def test_authentication_and_roles(client: TestClient, tokens: Tokens) -> None:
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers=auth("gf_nothing_here")).status_code == 401
    assert client.get("/v1/jobs", headers=auth("not-a-token")).status_code == 401
    forged = tokens.alice[:-4] + "AAAA"
    assert client.get("/v1/jobs", headers=auth(forged)).status_code == 401
    assert client.get("/v1/jobs", headers=auth(tokens.agent)).status_code == 403
    assert client.post("/v1/jobs", json=spec(), headers=auth(tokens.agent)).status_code == 403


def test_cluster_health_and_metrics(client: TestClient, tokens: Tokens) -> None:
    client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice))
    cluster = client.get("/v1/cluster", headers=auth(tokens.operator)).json()
    assert cluster["jobs_by_state"]["QUEUED"] == 1
    assert cluster["gpus_total"] == cluster["gpus_used"] + cluster["gpus_free"]
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok"}
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert 'greenflow_jobs{state="QUEUED"} 1.0' in metrics.text
    # Counted by route template and status (a refused request too).
    client.get("/v1/jobs/99", headers=auth(tokens.alice))
    metrics = client.get("/metrics")
    counted = metrics.text
    assert (
        'greenflow_http_requests_total{method="POST",route="/v1/jobs",status="201"} 1.0' in counted
    )
    assert (
        'greenflow_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="404"} 1.0'
        in counted
    )
