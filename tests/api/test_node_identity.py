"""Per-node identity and untrusted telemetry (issue 17, items 1 and 2).

Each test reproduces one defect of the outside review: a forged `finished` sample, an
`Infinity` energy, an impostor re-registering a node, a secret stored in plaintext.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text

from scheduler_service.auth.service import create_token
from scheduler_service.auth.tokens import Role
from scheduler_service.db.models import Allocation, Job, LedgerEntry, Node, TelemetrySample
from scheduler_service.db.session import transaction
from scheduler_service.nodes.agent_client import AgentClient, AgentUnreachable
from scheduler_service.telemetry import service as ingest_service
from tests.api.conftest import Tokens, auth
from tests.api.test_jobs_api import spec
from worker_agent.protocol import AllocationCommand, TelemetryReport, WorkloadSpec

# The acknowledgement's node power counts, for reports that carry no node power samples.
NO_NODE_POWER = {"node_power_stored": 0, "node_power_rejected": 0}


def _registration(name: str, gpus: int = 2, url: str = "http://127.0.0.1:9") -> dict[str, Any]:
    return {"name": name, "agent_url": url, "slots": [{"index": i} for i in range(gpus)]}


def _node_token(client: TestClient, name: str) -> str:
    with transaction(client.app.state.session_factory) as session:  # type: ignore[attr-defined]
        return create_token(session, name=name, role=Role.AGENT)


def _register(client: TestClient, token: str, name: str, **kw: Any) -> Any:
    return client.post("/v1/nodes/register", json=_registration(name, **kw), headers=auth(token))


def _sample(job_id: int, generation: int = 1, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "sample_id": uuid.uuid4().hex,
        "job_id": job_id,
        "generation": generation,
        "at": datetime.now(UTC).isoformat(),
        "interval_s": 5.0,
        "step": 1,
        "samples_done": 8,
        "samples_per_s": 1.6,
        "gpus": 1,
        "power_w": 300.0,
        "energy_kwh": 300.0 * 5 / 3.6e6,
        "power_source": "estimated",
    }
    body.update(overrides)
    return body


def _submit(client: TestClient, tokens: Tokens, **overrides: Any) -> int:
    response = client.post("/v1/jobs", json=spec(**overrides), headers=auth(tokens.alice))
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def _place(client: TestClient, job_id: int, node_name: str, generation: int = 1) -> None:
    """What the control loop does when it sends a job to a node: an allocation, sent."""
    with transaction(client.app.state.session_factory) as session:  # type: ignore[attr-defined]
        node = session.scalar(select(Node).where(Node.name == node_name))
        assert node is not None
        now = datetime.now(UTC)
        session.add(
            Allocation(
                job_id=job_id,
                generation=generation,
                node_id=node.id,
                gpus=1,
                slot_indices=[0],
                status="acked",
                created_at=now - timedelta(seconds=30),
                sent_at=now - timedelta(seconds=30),
                acked_at=now - timedelta(seconds=29),
            )
        )


def _rejected_metric(client: TestClient, reason: str) -> float:
    text = client.get("/metrics").text
    prefix = f'greenflow_telemetry_samples_rejected_total{{reason="{reason}"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def _job(client: TestClient, job_id: int) -> Job:
    with transaction(client.app.state.session_factory) as session:  # type: ignore[attr-defined]
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _stored_samples(client: TestClient, job_id: int) -> int:
    with transaction(client.app.state.session_factory) as session:  # type: ignore[attr-defined]
        rows = session.scalars(select(TelemetrySample).where(TelemetrySample.job_id == job_id))
        return len(list(rows))


def test_forged_finished_sample_leaves_a_queued_job_alone(
    client: TestClient, tokens: Tokens
) -> None:
    # Review: one sample with finished=true from any agent token moved a user's QUEUED job
    # (begin_after 2099) to SUCCEEDED.
    assert _register(client, tokens.agent, "node-1").status_code == 200
    intruder = _node_token(client, "node-2")
    assert _register(client, intruder, "node-2").status_code == 200
    job_id = _submit(client, tokens, begin_after="2099-01-01T00:00:00Z")
    before = _rejected_metric(client, "not_placed_here")
    for token, node in ((intruder, "node-2"), (tokens.agent, "node-1")):
        forged = _sample(job_id, finished=True, samples_done=10**9)
        response = client.post(
            "/v1/telemetry", json={"samples": [forged], "node": node}, headers=auth(token)
        )
        assert response.status_code == 200, response.text
        assert response.json() == {"stored": 0, "duplicates": 0, "rejected": 1, **NO_NODE_POWER}
    assert _job(client, job_id).state == "QUEUED"
    assert _job(client, job_id).samples_done == 0
    assert _stored_samples(client, job_id) == 0
    assert _rejected_metric(client, "not_placed_here") == before + 2


def test_a_node_cannot_report_in_another_nodes_name(client: TestClient, tokens: Tokens) -> None:
    assert _register(client, tokens.agent, "node-1").status_code == 200
    intruder = _node_token(client, "node-2")
    assert _register(client, intruder, "node-2").status_code == 200
    job_id = _submit(client, tokens)
    _place(client, job_id, "node-1")
    response = client.post(
        "/v1/telemetry",
        json={"samples": [_sample(job_id)], "node": "node-1"},
        headers=auth(intruder),
    )
    assert response.status_code == 403
    assert "node-2" in response.json()["detail"]
    # Without naming a node, the intruder speaks for its own: the job is not placed there.
    response = client.post(
        "/v1/telemetry", json={"samples": [_sample(job_id)]}, headers=auth(intruder)
    )
    assert response.json()["rejected"] == 1
    assert _stored_samples(client, job_id) == 0


def test_the_placed_node_reports_and_finishes_its_job(client: TestClient, tokens: Tokens) -> None:
    assert _register(client, tokens.agent, "node-1").status_code == 200
    job_id = _submit(client, tokens)
    _place(client, job_id, "node-1")
    earlier = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    good = _sample(job_id, generation=1, at=earlier)
    response = client.post("/v1/telemetry", json={"samples": [good]}, headers=auth(tokens.agent))
    assert response.json() == {"stored": 1, "duplicates": 0, "rejected": 0, **NO_NODE_POWER}
    # A generation that was never sent to this node is not its to report.
    stale = _sample(job_id, generation=7)
    response = client.post("/v1/telemetry", json={"samples": [stale]}, headers=auth(tokens.agent))
    assert response.json()["rejected"] == 1
    done = _sample(job_id, finished=True, samples_done=16)
    response = client.post("/v1/telemetry", json={"samples": [done]}, headers=auth(tokens.agent))
    assert response.json()["stored"] == 1
    assert _job(client, job_id).state == "SUCCEEDED"


def test_energy_beyond_the_nodes_gpus_is_refused(client: TestClient, tokens: Tokens) -> None:
    assert _register(client, tokens.agent, "node-1", gpus=2).status_code == 200
    job_id = _submit(client, tokens)
    _place(client, job_id, "node-1")
    # 2 GPUs at the default 1,500 W each for 5 s is 0.00417 kWh; claim ten times that.
    greedy = _sample(job_id, energy_kwh=0.0417)
    before = _rejected_metric(client, "energy_above_node_maximum")
    response = client.post("/v1/telemetry", json={"samples": [greedy]}, headers=auth(tokens.agent))
    assert response.json()["rejected"] == 1
    assert _rejected_metric(client, "energy_above_node_maximum") == before + 1
    # Overlapping intervals cannot multiply a node's energy either.
    first = _sample(job_id)
    again = _sample(job_id)  # a new id, the same 5 s
    response = client.post(
        "/v1/telemetry", json={"samples": [first, again]}, headers=auth(tokens.agent)
    )
    assert response.json() == {"stored": 1, "duplicates": 0, "rejected": 1, **NO_NODE_POWER}


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN", "1e999"])
def test_non_finite_energy_is_422_and_never_reaches_the_ledger(
    client: TestClient, tokens: Tokens, literal: str
) -> None:
    # Review: one sample with "energy_kwh": Infinity made the day's ledger infinite.
    assert _register(client, tokens.agent, "node-1").status_code == 200
    job_id = _submit(client, tokens)
    _place(client, job_id, "node-1")
    body = json.dumps({"samples": [_sample(job_id, energy_kwh=0.5)]}).replace("0.5", literal)
    response = client.post(
        "/v1/telemetry",
        content=body,
        headers={**auth(tokens.agent), "content-type": "application/json"},
    )
    assert response.status_code == 422, response.text
    assert "energy_kwh" in response.text
    assert _stored_samples(client, job_id) == 0
    with transaction(client.app.state.session_factory) as session:  # type: ignore[attr-defined]
        assert list(session.scalars(select(LedgerEntry))) == []
    budget = client.get("/v1/budget", headers=auth(tokens.operator)).json()
    assert budget["periods"][0]["spent_kg_co2e"] == 0.0


def test_impostor_cannot_take_over_a_registered_node(client: TestClient, tokens: Tokens) -> None:
    # Review: registering an existing node's name with any agent token replaced its address
    # and secret; the scheduler then sent that node's commands to the impostor.
    first = _register(client, tokens.agent, "node-1", url="http://127.0.0.1:9")
    assert first.status_code == 200
    impostor = _node_token(client, "node-666")
    response = _register(client, impostor, "node-1", url="http://198.18.0.66:9")
    assert response.status_code == 403
    assert "greenflow node enrol node-1" in response.json()["detail"]
    nodes = client.get("/v1/nodes", headers=auth(tokens.operator)).json()
    assert [(n["name"], n["agent_url"]) for n in nodes] == [("node-1", "http://127.0.0.1:9")]
    beat = client.post("/v1/nodes/node-1/heartbeat", json={"jobs": []}, headers=auth(impostor))
    assert beat.status_code == 403
    # Its own credential re-registers it, and the secret toward the agent changes each time.
    again = _register(client, tokens.agent, "node-1")
    assert again.status_code == 200
    assert again.json()["agent_secret"] != first.json()["agent_secret"]


def test_the_agent_secret_is_not_stored(client: TestClient, tokens: Tokens) -> None:
    response = _register(client, tokens.agent, "node-1")
    secret = response.json()["agent_secret"]
    assert len(secret) == 64
    with transaction(client.app.state.session_factory) as session:  # type: ignore[attr-defined]
        node = session.scalar(select(Node).where(Node.name == "node-1"))
        assert node is not None
        stored = [str(getattr(node, c.key)) for c in Node.__table__.columns]
    assert all(secret not in value for value in stored)


def test_a_revoked_or_expired_node_credential_stops_working(
    client: TestClient, tokens: Tokens
) -> None:
    from scheduler_service.nodes.service import revoke_node

    assert _register(client, tokens.agent, "node-1").status_code == 200
    with transaction(client.app.state.session_factory) as session:  # type: ignore[attr-defined]
        assert revoke_node(session, "node-1") == 1
        expired = create_token(
            session,
            name="node-2",
            role=Role.AGENT,
            expires_at=datetime.now(UTC) - timedelta(seconds=1),
        )
    # As after the token cache's few seconds (tests/api/test_token_cache.py covers the wait).
    client.app.state.token_cache.clear()  # type: ignore[attr-defined]
    assert _register(client, tokens.agent, "node-1").status_code == 401
    assert _register(client, expired, "node-2").status_code == 401
    nodes = client.get("/v1/nodes", headers=auth(tokens.operator)).json()
    assert nodes[0]["state"] == "lost"


def test_a_revoked_node_credential_cannot_register_again_even_while_cached(
    client: TestClient, tokens: Tokens
) -> None:
    from scheduler_service.nodes.service import revoke_node

    assert _register(client, tokens.agent, "node-1").status_code == 200
    # The token is now in the process's token cache; revoking takes the node out of service.
    with transaction(client.app.state.session_factory) as session:  # type: ignore[attr-defined]
        assert revoke_node(session, "node-1") == 1
    # Registering would put it back in service: it reads the credential afresh, so 401 at once.
    assert _register(client, tokens.agent, "node-1").status_code == 401
    nodes = client.get("/v1/nodes", headers=auth(tokens.operator)).json()
    assert nodes[0]["state"] == "lost"


def test_registration_refuses_addresses_that_could_not_be_called(
    client: TestClient, tokens: Tokens
) -> None:
    # Review: a node with a non-ASCII secret stopped the control loop for the whole cluster.
    for url in ("http://nödé:9", "http://127.0.0.1:9/\u0000", "ftp://127.0.0.1"):
        response = _register(client, tokens.agent, "node-1", url=url)
        assert response.status_code == 422, url
        assert "agent_url" in response.text


async def test_one_unusable_agent_address_is_that_nodes_failure_only() -> None:
    # Whatever a node's address or secret holds, the client raises its one "unreachable"
    # error, which the control loop records per command, never an error that fails the tick.
    client = AgentClient(timeout_s=2, attempts=1)
    command = AllocationCommand(
        job_id=1,
        generation=1,
        slot_indices=[0],
        spec=WorkloadSpec(workload="mlp", global_batch_size=8, total_samples=80),
        issued_at=datetime.now(UTC),
    )
    try:
        for url, secret in (("http://127.0.0.1:9", "sécret"), ("http://[::1", "s" * 64)):
            with pytest.raises(AgentUnreachable):
                await client.apply(url, secret, command)
    finally:
        await client.aclose()


def test_token_names_are_unique_per_role_and_tokens_revocable(
    client: TestClient, tokens: Tokens
) -> None:
    from scheduler_service.auth.service import TokenError, list_tokens, revoke_token

    factory = client.app.state.session_factory  # type: ignore[attr-defined]
    with transaction(factory) as session, pytest.raises(TokenError, match="exists"):
        create_token(session, name="alice", role=Role.USER)
    with transaction(factory) as session:
        # Another role may share the name; replacing revokes the old token.
        create_token(session, name="alice", role=Role.OPERATOR)
        new_alice = create_token(session, name="alice", role=Role.USER, replace=True)
    client.app.state.token_cache.clear()  # type: ignore[attr-defined]  # as after its TTL
    assert client.get("/v1/jobs", headers=auth(tokens.alice)).status_code == 401
    assert client.get("/v1/jobs", headers=auth(new_alice)).status_code == 200
    with transaction(factory) as session:
        revoke_token(session, new_alice.split("_")[1])
        active = {(t.name, t.role) for t in list_tokens(session)}
    assert ("alice", "user") not in active and ("alice", "operator") in active
    client.app.state.token_cache.clear()  # type: ignore[attr-defined]  # as after its TTL
    assert client.get("/v1/jobs", headers=auth(new_alice)).status_code == 401


@pytest.mark.parametrize(
    "presented",
    ["gf_abc\u0000def_secret", "gf_abcdef_sécret", "gf_\udcff_x", "gf__", "x" * 10_000],
)
def test_malformed_bearer_tokens_are_401_not_500(client: TestClient, presented: str) -> None:
    # Review: a NUL or non-ASCII byte in a token reached the database query (500).
    raw = presented.encode("utf-8", "surrogateescape")
    response = client.get("/v1/jobs", headers=[(b"authorization", b"Bearer " + raw)])
    assert response.status_code == 401


@pytest.mark.postgres
@pytest.mark.parametrize("with_job_samples", [True, False])
def test_the_same_batch_posted_twice_at_once_is_stored_once(
    client: TestClient, tokens: Tokens, database_url: str, with_job_samples: bool
) -> None:
    """An agent re-sends a batch whose first post timed out while that post is still being
    written: the later inserts of the same sample ids (job samples and node power) must count
    as duplicates, not answer 500 with a unique-key violation."""
    if not database_url.startswith("postgresql"):
        pytest.skip("needs PostgreSQL's row-level waits to interleave the writers")
    assert _register(client, tokens.agent, "node-1").status_code == 200
    job_id = _submit(client, tokens)
    _place(client, job_id, "node-1")
    now = datetime.now(UTC)
    power = {
        "sample_id": f"np-{uuid.uuid4().hex}",
        "at": now.isoformat(),
        "interval_s": 5.0,
        "readings": [
            {"component": "host", "device": "host", "energy_j": 500.0, "source": "estimated"}
        ],
    }
    samples = [_sample(job_id, at=(now - timedelta(seconds=5)).isoformat())]
    batch = {
        "samples": samples if with_job_samples else [],
        "node_power": [power],
        "node": "node-1",
    }
    app: Any = client.app
    answers: list[Any] = []

    def post() -> None:
        answers.append(client.post("/v1/telemetry", json=batch, headers=auth(tokens.agent)))

    # The first post, still writing: its rows are inserted but not committed, so the two
    # re-sends read "not stored yet" and then wait on its unique keys.
    first = app.state.session_factory()
    limits = ingest_service.TelemetryLimits(
        max_power_per_gpu_w=1500.0, rate_factor=20.0, grace_s=60.0
    )
    done = ingest_service.ingest(first, "node-1", TelemetryReport.model_validate(batch), limits)
    assert (done.stored, done.node_power_stored) == (len(batch["samples"]), 1)
    threads = [threading.Thread(target=post) for _ in range(2)]
    for t in threads:
        t.start()
    until = time.monotonic() + 30
    while time.monotonic() < until:
        waiting = first.execute(
            text("SELECT count(*) FROM pg_locks WHERE NOT granted")
        ).scalar_one()
        if waiting >= 2:
            break
        time.sleep(0.05)
    first.commit()
    first.close()
    for t in threads:
        t.join(60)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    for a in answers:
        ack = a.json()
        assert (ack["stored"], ack["node_power_stored"], ack["rejected"]) == (0, 0, 0)
        assert ack["duplicates"] == 1 + len(batch["samples"])
    assert _stored_samples(client, job_id) == len(batch["samples"])
