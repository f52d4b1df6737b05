"""While the database is down the API answers honestly (issue 17, item 4).

Review: during a 20 s outage every call, /healthz included, answered a bare text/plain 500, 20
connections were dropped unanswered and the log took 4,128 tracebacks. This test starts its own
PostgreSQL (the shared one must never go down under other tests), stops it under a real
`greenflow serve`, and starts it again.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from scheduler_service.db import migrate
from tests.api.conftest import make_tokens
from tests.support.private_postgres import postgres_available, private_postgres
from tests.support.processes import free_port, running, wait_http_ok

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.skipif(not postgres_available(), reason="no initdb/pg_ctl here"),
]


def _call(url: str, token: str, kind: int) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, timeout=30) as client:
        if kind % 3 == 0:
            return client.get("/v1/jobs", headers=headers)
        if kind % 3 == 1:
            body = {
                "name": f"j{kind}",
                "workload": "gpt2",
                "global_batch_size": 8,
                "total_steps": 5,
            }
            return client.post("/v1/jobs", json=body, headers=headers)
        return client.get("/healthz")


def test_outage_answers_503_json_and_recovers(tmp_path: Path) -> None:
    with private_postgres() as server:
        migrate.upgrade(server.url)
        tokens = make_tokens(server.url)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {
            "GREENFLOW_DATABASE_URL": server.url,
            "GREENFLOW_PORT": str(port),
            "GREENFLOW_RUN_CONTROL_LOOP": "false",
            "GREENFLOW_SECRET_KEY": "k" * 48,
        }
        log = tmp_path / "serve.log"
        with running(["serve"], env, log) as process:
            # Generous: a loaded CI machine takes a while to import the service.
            wait_http_ok(f"{url}/healthz", timeout_s=180, process=process)
            assert _call(url, tokens.alice, 0).status_code == 200
            server.stop()
            with ThreadPoolExecutor(max_workers=20) as pool:
                answers = list(pool.map(lambda k: _call(url, tokens.alice, k), range(40)))
            # Every connection answered (none dropped), each a 503 naming the database.
            assert len(answers) == 40
            for answer in answers:
                assert answer.status_code == 503, answer.text
                assert answer.headers["content-type"] == "application/json"
                assert int(answer.headers["retry-after"]) > 0
                assert "database" in answer.text
            live = httpx.get(f"{url}/livez", timeout=10)
            assert live.status_code == 200 and live.json() == {"status": "ok"}
            server.start()
            deadline = time.monotonic() + 60
            while httpx.get(f"{url}/healthz", timeout=10).status_code != 200:
                assert time.monotonic() < deadline, "did not recover"
                time.sleep(0.5)
            assert _call(url, tokens.alice, 1).status_code == 201
        text = log.read_text()
        assert text.count("database unavailable") == 1, text[-3000:]
        assert text.count("database available again") == 1, text[-3000:]
        assert "Traceback" not in text
