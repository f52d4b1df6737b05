"""Issue 17, item 6: security headers, slowed guessing, and the operator's workload allow-list."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from scheduler_service.app import create_app
from scheduler_service.auth.service import revoke_token
from scheduler_service.db import migrate
from scheduler_service.db.session import transaction
from scheduler_service.settings import GreenflowConfig, Settings, WorkloadConfig
from tests.api.conftest import Tokens, auth, make_tokens
from tests.api.test_jobs_api import spec


def test_security_headers_on_every_kind_of_answer(client: TestClient, tokens: Tokens) -> None:
    answers = [
        client.get("/v1/jobs", headers=auth(tokens.alice)),  # JSON
        client.get("/v1/jobs/999", headers=auth(tokens.alice)),  # domain error
        client.get("/v1/jobs?limit=0", headers=auth(tokens.alice)),  # validation error
        client.get("/console/login"),  # HTML
        client.post("/v1/jobs", content=b"[" + b"1," * 600_000 + b"1]"),  # refused at the edge
    ]
    for answer in answers:
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
        assert answer.headers["referrer-policy"] in ("no-referrer", "same-origin")
    assert answers[0].headers["cache-control"] == "no-store"


def test_failed_bearer_checks_slow_the_address_down(client: TestClient, tokens: Tokens) -> None:
    # Review: no rate limit or delay on failed sign-ins and bearer checks.
    wrong = "gf_0123456789abcdef_" + "x" * 43
    codes = [client.get("/v1/jobs", headers=auth(wrong)).status_code for _ in range(6)]
    assert codes == [401] * 6
    blocked = client.get("/v1/jobs", headers=auth(tokens.alice))
    assert blocked.status_code == 429
    assert int(blocked.headers["retry-after"]) >= 1
    login = client.post("/console/login", data={"token": tokens.alice})
    assert login.status_code == 429


@pytest.fixture
def guarded_client(tmp_path: Path) -> Iterator[tuple[TestClient, Tokens]]:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    migrate.upgrade(url)
    config = GreenflowConfig(
        workloads=WorkloadConfig(
            allowed_entrypoints=["my_pkg"], queues={"research": ["lab.models:*"]}
        )
    )
    app = create_app(Settings(database_url=url, run_control_loop=False), config)
    with TestClient(app) as client:
        yield client, make_tokens(url)
    app.state.engine.dispose()


def test_entrypoints_run_only_where_the_operator_allows(
    client: TestClient, tokens: Tokens, guarded_client: tuple[TestClient, Tokens]
) -> None:
    # Review: any user could name any importable module:function (os:system) as a workload.
    response = client.post("/v1/jobs", json=spec(workload="os:system"), headers=auth(tokens.alice))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "workload"]
    assert client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice)).status_code == 201
    guarded, its_tokens = guarded_client
    cases = [
        ("my_pkg.train:main", "default", 201),
        ("my_pkg:main", "default", 201),
        ("my_pkgx:main", "default", 422),
        ("os:system", "default", 422),
        ("lab.models:resnet", "research", 201),
        ("my_pkg.train:main", "research", 422),
    ]
    for workload, queue, code in cases:
        body = spec(workload=workload, queue=queue)
        answer = guarded.post("/v1/jobs", json=body, headers=auth(its_tokens.alice))
        assert answer.status_code == code, (workload, queue, answer.text)


def _console_form_token(client: TestClient, path: str) -> str:
    page = client.get(path)
    match = re.search(r'name="form_token" value="([0-9a-f]{64})"', page.text)
    assert match, page.text[:500]
    return match.group(1)


def test_console_sessions_are_server_side(client: TestClient, tokens: Tokens) -> None:
    # Review: the console cookie was the raw API token and its form token never changed.
    job = client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice)).json()
    path = f"/console/jobs/{job['id']}"
    forms = []
    for _ in range(2):
        client.cookies.clear()
        login = client.post("/console/login", data={"token": tokens.alice}, follow_redirects=False)
        assert login.status_code == 303
        cookie = client.cookies["greenflow_console"]
        assert cookie not in tokens.alice and tokens.alice.split("_", 2)[2] not in cookie
        forms.append((cookie, _console_form_token(client, path)))
    assert forms[0][0] != forms[1][0] and forms[0][1] != forms[1][1]
    # Signing out ends the session on the server: its cookie no longer works.
    client.post("/console/logout", data={"form_token": forms[1][1]}, follow_redirects=False)
    client.cookies.set("greenflow_console", forms[1][0], path="/console")
    assert client.get(path, follow_redirects=False).status_code == 303
    # Revoking the token ends its sessions too.
    client.cookies.set("greenflow_console", forms[0][0], path="/console")
    assert client.get(path, follow_redirects=False).status_code == 200
    factory = client.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session:
        revoke_token(session, tokens.alice.split("_")[1])
    assert client.get(path, follow_redirects=False).status_code == 303


def test_console_forms_from_another_origin_are_refused(client: TestClient, tokens: Tokens) -> None:
    # Review: no Origin check.
    job = client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice)).json()
    path = f"/console/jobs/{job['id']}"
    client.post("/console/login", data={"token": tokens.alice})
    form = _console_form_token(client, path)
    evil = client.post(
        f"{path}/cancel", data={"form_token": form}, headers={"Origin": "https://evil.example"}
    )
    assert evil.status_code == 403
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth(tokens.alice)).json()["state"] == (
        "QUEUED"
    )
    own = client.post(
        f"{path}/cancel", data={"form_token": form}, headers={"Origin": "http://testserver"}
    )
    assert own.status_code == 200
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth(tokens.alice)).json()["state"] == (
        "CANCELLED"
    )


def test_api_docs_load_nothing_from_another_origin(client: TestClient) -> None:
    # Review: /docs loaded Swagger UI from a CDN.
    page = client.get("/docs")
    assert page.status_code == 200
    assert not re.search(r"https?://", page.text)
    assets = re.findall(r"""(?:src|href)=["']?([^"' >]+)""", page.text)
    assert len(assets) >= 2
    for asset in assets:
        assert asset.startswith("/console/static/vendor/"), asset
        assert client.get(asset).status_code == 200, asset
