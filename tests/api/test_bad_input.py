"""No input produces a 500 (issue 17, item 3): each case the outside review found, as a 4xx that
names the field, and nothing stored."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import Tokens, auth
from tests.api.test_jobs_api import spec
from tests.api.test_node_identity import _register, _sample
from tests.support.processes import run_cli

JSON = {"content-type": "application/json"}


def _post_raw(client: TestClient, path: str, body: str, token: str) -> Any:
    return client.post(
        path, content=body.encode("utf-8", "surrogatepass"), headers={**auth(token), **JSON}
    )


def _job_count(client: TestClient, tokens: Tokens) -> int:
    return int(client.get("/v1/jobs", headers=auth(tokens.operator)).json()["total"])


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_in_a_user_body_are_422(
    client: TestClient, tokens: Tokens, literal: str
) -> None:
    # Review: the 422 echoed the value and then failed to serialise it (500).
    body = json.dumps(spec(priority=7)).replace('"priority": 7', f'"priority": {literal}')
    response = _post_raw(client, "/v1/jobs", body, tokens.alice)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "priority"]
    priority = json.dumps({"priority": 1}).replace("1", literal)
    response = _post_raw(client, "/v1/jobs/1/priority", priority, tokens.operator)
    assert response.status_code == 422
    assert _job_count(client, tokens) == 0


@pytest.mark.parametrize("text", ["\u0000", "a\u0000b", "\ud800", "x\udfff"])
def test_nul_and_lone_surrogates_in_strings_are_422(
    client: TestClient, tokens: Tokens, text: str
) -> None:
    # Review: PostgreSQL rejects NUL in text (500); a lone surrogate cannot be encoded at all.
    body = json.dumps(spec(name=f"job{text}"))  # \\u escapes: valid JSON text
    response = _post_raw(client, "/v1/jobs", body, tokens.alice)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "name"]
    json.dumps(response.json())  # the answer itself is clean
    job = client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice)).json()
    reason = json.dumps({"reason": f"because{text}"})
    response = _post_raw(client, f"/v1/jobs/{job['id']}/cancel", reason, tokens.alice)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "reason"]
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth(tokens.alice)).json()["state"] != (
        "CANCELLED"
    )


def test_nul_in_query_filters_and_forms_is_422(client: TestClient, tokens: Tokens) -> None:
    for path in ("/v1/jobs?owner=%00", "/v1/jobs?queue=a%00b", "/console/jobs?owner=%00"):
        response = client.get(path, headers=auth(tokens.operator))
        assert response.status_code == 422, (path, response.text)
        assert response.json()["detail"][0]["loc"][0] == "query"
    response = client.post("/console/login", data={"token": "gf_a\u0000b_c"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "token"]


def test_a_non_ascii_console_form_token_is_refused_not_500(
    client: TestClient, tokens: Tokens
) -> None:
    # Review: hmac.compare_digest raised on a non-ASCII form token (500).
    login = client.post("/console/login", data={"token": tokens.operator}, follow_redirects=False)
    assert login.status_code == 303
    job = client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice)).json()
    response = client.post(f"/console/jobs/{job['id']}/cancel", data={"form_token": "jeton-é"})
    assert 400 <= response.status_code < 500


def test_far_dates_are_422_not_an_overflow(client: TestClient, tokens: Tokens) -> None:
    # Review: deadline 9999-12-31T23:59:59-14:00 overflowed once moved to UTC (500).
    for field in ("deadline", "begin_after"):
        response = client.post(
            "/v1/jobs",
            json=spec(**{field: "9999-12-31T23:59:59-14:00"}),
            headers=auth(tokens.alice),
        )
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == ["body", field]


def test_agent_payloads_are_bounded(client: TestClient, tokens: Tokens) -> None:
    # Review: int64 overflow and schema-violating bodies ("finished": 0) on the agent endpoints.
    assert _register(client, tokens.agent, "node-1").status_code == 200
    cases: list[tuple[dict[str, Any], str]] = [
        (_sample(2**64), "job_id"),
        (_sample(1, step=2**63), "step"),
        (_sample(1, finished=0), "finished"),
        (_sample(1, sample_id="a\u0000b"), "sample_id"),
        (_sample(1, energy_kwh=1e308), "energy_kwh"),
        (_sample(1, at="9999-12-31T23:59:59-14:00"), "at"),
    ]
    for sample, field in cases:
        response = client.post(
            "/v1/telemetry", json={"samples": [sample]}, headers=auth(tokens.agent)
        )
        assert response.status_code == 422, (field, response.text)
        assert field in json.dumps(response.json()["detail"][0]["loc"])
    beat = {
        "jobs": [
            {
                "job_id": 2**63,
                "generation": 1,
                "gpus": 1,
                "slot_indices": [0],
                "layout": None,
                "step": 0,
                "samples_done": 0,
                "worker_pids": [],
            }
        ]
    }
    response = client.post("/v1/nodes/node-1/heartbeat", json=beat, headers=auth(tokens.agent))
    assert response.status_code == 422


def test_a_large_body_is_refused_fast(client: TestClient, tokens: Tokens) -> None:
    # Review: a 10 MB array body took 9 s to reject.
    body = "[" + ",".join(["1"] * 5_000_000) + "]"
    started = time.monotonic()
    response = _post_raw(client, "/v1/jobs", body, tokens.alice)
    assert response.status_code == 413
    assert "larger than" in response.json()["detail"]
    assert time.monotonic() - started < 30  # a sanity bound only: the point is the 413


def test_cli_submit_of_an_unreadable_file_is_one_line_exit_2(tmp_path: Path) -> None:
    # Review: `greenflow submit` of a non-UTF-8 file printed a 35-line traceback, exit 1.
    latin = tmp_path / "job.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    env = {"GREENFLOW_URL": "http://127.0.0.1:9", "GREENFLOW_TOKEN": "gf_x_y"}
    for path in (latin, tmp_path):  # not UTF-8; a directory
        result = run_cli(["submit", str(path)], env)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr
