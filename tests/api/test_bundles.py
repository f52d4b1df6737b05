"""Workdir bundles over the API: upload by SHA-256, who may read them, jobs that name them."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from scheduler_service.app import create_app
from scheduler_service.bundles.repository import BundleRepository
from scheduler_service.bundles.service import sweep_bundles
from scheduler_service.control_loop import BUNDLE_SWEEP_S, ControlLoop
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Bundle, GpuSlot, Job
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.settings import GreenflowConfig, Settings, WorkloadConfig
from tests.api.conftest import Tokens, auth
from tests.api.test_jobs_api import register_node
from worker_agent.bundle import pack_directory
from worker_agent.protocol import Heartbeat, RunningJob


@pytest.fixture
def bundle_client(database_url: str) -> Iterator[TestClient]:
    """The app with user job modules `user_job` allowed and a 64 KiB bundle limit."""
    settings = Settings(
        database_url=database_url, run_control_loop=False, max_bundle_bytes=64 * 1024
    )
    config = GreenflowConfig(workloads=WorkloadConfig(allowed_entrypoints=["user_job"]))
    app = create_app(settings, config)
    with TestClient(app) as test_client:
        yield test_client
    app.state.engine.dispose()


def _bundle(tmp_path: Path) -> tuple[bytes, str]:
    (tmp_path / "user_job.py").write_text("def job(**options):\n    return {}\n")
    bundle = pack_directory(tmp_path)
    return bundle.data, bundle.sha256


def _put(client: TestClient, token: str, sha: str, data: bytes) -> tuple[int, dict[str, object]]:
    response = client.put(
        f"/v1/bundles/{sha}",
        content=data,
        headers={**auth(token), "content-type": "application/octet-stream"},
    )
    return response.status_code, response.json()


def _job(sha: str | None, **extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "name": "mine",
        "workload": "user_job:job",
        "global_batch_size": 8,
        "total_steps": 10,
        **extra,
    }
    if sha is not None:
        body["bundle"] = sha
    return body


def test_upload_is_idempotent_and_checked(
    bundle_client: TestClient, tokens: Tokens, tmp_path: Path
) -> None:
    data, sha = _bundle(tmp_path)
    assert _put(bundle_client, tokens.alice, sha, data) == (
        201,
        {"sha256": sha, "size_bytes": len(data)},
    )
    assert _put(bundle_client, tokens.alice, sha, data)[0] == 200
    status, body = _put(bundle_client, tokens.alice, "0" * 64, data)
    assert status == 422 and sha in str(body["detail"])
    big = b"z" * (65 * 1024)
    assert _put(bundle_client, tokens.alice, hashlib.sha256(big).hexdigest(), big)[0] == 413
    assert _put(bundle_client, tokens.alice, "not-a-hash", data)[0] == 422
    assert _put(bundle_client, tokens.agent, sha, data)[0] == 403


def test_who_reads_a_bundle(bundle_client: TestClient, tokens: Tokens, tmp_path: Path) -> None:
    data, sha = _bundle(tmp_path)
    _put(bundle_client, tokens.alice, sha, data)
    got = bundle_client.get(f"/v1/bundles/{sha}", headers=auth(tokens.alice))
    assert got.status_code == 200 and got.content == data
    assert bundle_client.get(f"/v1/bundles/{sha}", headers=auth(tokens.operator)).status_code == 200
    # Another user, and an agent whose node runs none of its jobs, see nothing.
    assert bundle_client.get(f"/v1/bundles/{sha}", headers=auth(tokens.bob)).status_code == 404
    assert bundle_client.get(f"/v1/bundles/{sha}", headers=auth(tokens.agent)).status_code == 404
    assert (
        bundle_client.get(f"/v1/bundles/{'1' * 64}", headers=auth(tokens.alice)).status_code == 404
    )


def test_a_job_names_a_stored_bundle_and_options(
    bundle_client: TestClient, tokens: Tokens, tmp_path: Path
) -> None:
    data, sha = _bundle(tmp_path)
    missing = bundle_client.post("/v1/jobs", json=_job(sha), headers=auth(tokens.alice))
    assert missing.status_code == 422 and "upload it first" in missing.text
    _put(bundle_client, tokens.alice, sha, data)
    created = bundle_client.post(
        "/v1/jobs", json=_job(sha, options={"layers": 2}), headers=auth(tokens.alice)
    )
    assert created.status_code == 201, created.text
    assert created.json()["bundle"] == sha and created.json()["options"] == {"layers": 2}
    preset = bundle_client.post(
        "/v1/jobs",
        json={**_job(sha), "workload": "gpt-tiny"},
        headers=auth(tokens.alice),
    )
    assert preset.status_code == 422 and "entrypoint" in preset.text


def test_a_job_whose_code_fails_on_its_node_fails_with_the_reason(
    bundle_client: TestClient, tokens: Tokens, tmp_path: Path, database_url: str
) -> None:
    data, sha = _bundle(tmp_path)
    _put(bundle_client, tokens.alice, sha, data)
    register_node(bundle_client, tokens)
    job_id = bundle_client.post("/v1/jobs", json=_job(sha), headers=auth(tokens.alice)).json()["id"]
    # Placed on node-1 (as the planner would): its agent may now read the bundle.
    engine = make_engine(database_url)
    with transaction(make_session_factory(engine)) as session:
        session.execute(update(GpuSlot).where(GpuSlot.index == 0).values(job_id=job_id))
    engine.dispose()
    got = bundle_client.get(f"/v1/bundles/{sha}", headers=auth(tokens.agent))
    assert got.status_code == 200 and got.content == data
    reason = "JobSpecError: cannot import job module 'user_job': SyntaxError: invalid syntax"
    running = RunningJob(
        job_id=job_id,
        generation=1,
        gpus=0,
        slot_indices=[],
        layout=None,
        step=0,
        samples_done=0,
        worker_pids=[],
        error=reason,
        job_error=True,
    )
    beat = Heartbeat(jobs=[running]).model_dump(mode="json")
    ack = bundle_client.post("/v1/nodes/node-1/heartbeat", json=beat, headers=auth(tokens.agent))
    assert ack.status_code == 200, ack.text
    assert ack.json()["stop_job_ids"] == [job_id]
    job = bundle_client.get(f"/v1/jobs/{job_id}", headers=auth(tokens.alice)).json()
    assert job["state"] == "FAILED"
    assert "the job's code failed on node node-1" in job["state_reason"]
    assert "SyntaxError" in job["state_reason"]


def test_logs_of_a_job_that_never_ran_are_empty(
    bundle_client: TestClient, tokens: Tokens, tmp_path: Path
) -> None:
    data, sha = _bundle(tmp_path)
    _put(bundle_client, tokens.alice, sha, data)
    job_id = bundle_client.post("/v1/jobs", json=_job(sha), headers=auth(tokens.alice)).json()["id"]
    got = bundle_client.get(f"/v1/jobs/{job_id}/logs", headers=auth(tokens.alice))
    assert got.status_code == 200, got.text
    assert got.json()["text"] == "" and got.json()["node"] is None
    assert got.json()["next_offset"] == 0
    other = bundle_client.get(f"/v1/jobs/{job_id}/logs", headers=auth(tokens.bob))
    assert other.status_code == 404
    tail = bundle_client.get(f"/v1/jobs/{job_id}/logs?tail=100", headers=auth(tokens.alice))
    assert tail.status_code == 200 and tail.json()["text"] == ""
    curve = bundle_client.get(f"/v1/jobs/{job_id}/curve", headers=auth(tokens.alice))
    assert curve.status_code == 200, curve.text
    assert curve.json() == {
        "job_id": job_id,
        "steps": [],
        "series": {},
        "lines": 0,
        "node": None,
    }
    assert (
        bundle_client.get(f"/v1/jobs/{job_id}/curve", headers=auth(tokens.bob)).status_code == 404
    )
    bad = bundle_client.get(f"/v1/jobs/{job_id}/curve?max_points=1", headers=auth(tokens.alice))
    assert bad.status_code == 422 and "max_points" in bad.text


def test_retention_sweep_removes_unused_bundles_and_an_upload_restores_them(
    bundle_client: TestClient, tokens: Tokens, tmp_path: Path, database_url: str
) -> None:
    """Four bundles, all last used 8 days ago under a 7-day retention: the one no job uses and
    the one whose job finished 8 days ago go; the one a queued job uses and the one whose job
    finished yesterday stay. A removed bundle says so (404 on read, 422 naming `bundle` on
    submit) until the same bytes are uploaded again."""
    shas: dict[str, str] = {}
    payloads: dict[str, bytes] = {}
    for name in ("unused", "queued", "finished_long_ago", "finished_lately"):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "user_job.py").write_text(f"def job(**options):\n    return {{}}  # {name}\n")
        bundle = pack_directory(directory)
        assert _put(bundle_client, tokens.alice, bundle.sha256, bundle.data)[0] == 201
        shas[name], payloads[name] = bundle.sha256, bundle.data
    job_ids = {}
    for name in ("queued", "finished_long_ago", "finished_lately"):
        created = bundle_client.post("/v1/jobs", json=_job(shas[name]), headers=auth(tokens.alice))
        assert created.status_code == 201, created.text
        job_ids[name] = created.json()["id"]
    now = utcnow()
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    try:
        with transaction(factory) as session:
            session.execute(update(Bundle).values(last_used_at=now - timedelta(days=8)))
            for name, finished in (("finished_long_ago", 8), ("finished_lately", 1)):
                session.execute(
                    update(Job)
                    .where(Job.id == job_ids[name])
                    .values(state="SUCCEEDED", finished_at=now - timedelta(days=finished))
                )
        with transaction(factory) as session:
            report = sweep_bundles(session, now, timedelta(days=7))
            stored = BundleRepository(session).stored_bytes()
        assert sorted(report.removed) == sorted([shas["unused"], shas["finished_long_ago"]])
        assert report.freed_bytes == len(payloads["unused"]) + len(payloads["finished_long_ago"])
        assert stored == len(payloads["queued"]) + len(payloads["finished_lately"])
        with transaction(factory) as session:  # a second sweep finds nothing more
            assert sweep_bundles(session, now, timedelta(days=7)).removed == []
    finally:
        engine.dispose()

    gone = shas["unused"]
    read = bundle_client.get(f"/v1/bundles/{gone}", headers=auth(tokens.alice))
    assert read.status_code == 404 and "was removed at" in read.text
    # Someone who never had it sees only "not found".
    other = bundle_client.get(f"/v1/bundles/{gone}", headers=auth(tokens.bob))
    assert other.status_code == 404 and "removed" not in other.text
    refused = bundle_client.post("/v1/jobs", json=_job(gone), headers=auth(tokens.alice))
    assert refused.status_code == 422
    assert "bundle" in refused.text and "upload it again" in refused.text
    kept = bundle_client.get(f"/v1/bundles/{shas['queued']}", headers=auth(tokens.alice))
    assert kept.status_code == 200 and kept.content == payloads["queued"]
    # The same bytes again: stored anew, readable, and a job may name it.
    assert _put(bundle_client, tokens.alice, gone, payloads["unused"])[0] == 201
    again = bundle_client.get(f"/v1/bundles/{gone}", headers=auth(tokens.alice))
    assert again.status_code == 200 and again.content == payloads["unused"]
    resubmitted = bundle_client.post("/v1/jobs", json=_job(gone), headers=auth(tokens.alice))
    assert resubmitted.status_code == 201, resubmitted.text


def test_the_control_loop_sweeps_with_the_configured_retention_at_most_hourly(
    bundle_client: TestClient, tokens: Tokens, tmp_path: Path, database_url: str
) -> None:
    data, sha = _bundle(tmp_path)
    _put(bundle_client, tokens.alice, sha, data)
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = GreenflowConfig(workloads=WorkloadConfig(bundle_retention_h=2))
    loop = ControlLoop(config, factory, engine)
    try:
        loop._sweep_bundles_if_due(utcnow() + timedelta(hours=1))  # within 2 h: kept
        with transaction(factory) as session:
            assert BundleRepository(session).size_of(sha) == len(data)
        # The next sweep is due an hour later, whatever time the tick says.
        loop._sweep_bundles_if_due(utcnow() + timedelta(hours=3))
        with transaction(factory) as session:
            assert BundleRepository(session).size_of(sha) == len(data)
        loop._bundles_swept_s -= BUNDLE_SWEEP_S
        loop._sweep_bundles_if_due(utcnow() + timedelta(hours=3))
        with transaction(factory) as session:
            assert BundleRepository(session).size_of(sha) is None
            assert BundleRepository(session).removed_at(sha) is not None
    finally:
        engine.dispose()


def test_init_from_names_a_finished_model_job_or_an_absolute_path(
    bundle_client: TestClient, tokens: Tokens, tmp_path: Path, database_url: str
) -> None:
    data, sha = _bundle(tmp_path)
    _put(bundle_client, tokens.alice, sha, data)

    def submit(token: str, **extra: object) -> tuple[int, str]:
        response = bundle_client.post("/v1/jobs", json=_job(sha, **extra), headers=auth(token))
        return response.status_code, response.text

    first = bundle_client.post("/v1/jobs", json=_job(sha), headers=auth(tokens.alice)).json()
    # Not finished yet: it has no export.
    status, text = submit(tokens.alice, init_from=f"job:{first['id']}")
    assert status == 422 and "init_from" in text and "is QUEUED" in text
    engine = make_engine(database_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            session.execute(
                update(Job)
                .where(Job.id == first["id"])
                .values(state="SUCCEEDED", finished_at=utcnow())
            )
    finally:
        engine.dispose()
    status, text = submit(tokens.alice, init_from=f"job:{first['id']}")
    assert status == 201, text
    job = bundle_client.get(f"/v1/jobs/{first['id'] + 1}", headers=auth(tokens.alice)).json()
    assert job["init_from"] == f"job:{first['id']}"
    status, text = submit(tokens.alice, init_from="/srv/models/llama/model.safetensors")
    assert status == 201, text
    # Someone else's job, one that does not exist, and malformed values: 422 naming init_from.
    for token, value, reason in (
        (tokens.bob, f"job:{first['id']}", "does not exist or is not yours"),
        (tokens.alice, "job:999999", "does not exist or is not yours"),
        (tokens.alice, "models/llama", "use job:<id>"),
        (tokens.alice, "/srv/../etc/passwd", "'..' components"),
        (tokens.alice, "job:0", "use job:<id>"),
    ):
        if token == tokens.bob:
            _put(bundle_client, tokens.bob, sha, data)
        status, text = submit(token, init_from=value)
        assert status == 422 and "init_from" in text and reason in text, (value, text)
    preset = {"name": "p", "workload": "gpt-tiny", "global_batch_size": 8, "total_steps": 5}
    refused = bundle_client.post(
        "/v1/jobs", json={**preset, "init_from": "job:1"}, headers=auth(tokens.alice)
    )
    assert refused.status_code == 422 and "init_from goes with" in refused.text
