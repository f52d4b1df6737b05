"""Every watt charged (issue 22): idle GPUs and the host are charged from the nodes' power
samples, attributed to jobs by GPU share and kept as the cluster's overhead, and what the ledger
holds adds up to what the nodes reported, to the watt-second."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from scheduler_service.budget import periods
from scheduler_service.budget.ledger import (
    attribution_shares,
    charge_new_telemetry,
    current_period,
    periods_for_horizon,
)
from scheduler_service.budget.periods import ReplayClock, period_containing, split_interval
from scheduler_service.db.models import LedgerEntry, NodePowerSampleRow
from scheduler_service.db.session import transaction
from scheduler_service.settings import GreenflowConfig
from tests.api.conftest import Tokens, auth
from tests.api.test_node_identity import _place, _register, _sample, _submit

J_PER_KWH = 3.6e6


def _reading(device: str, energy_j: float, source: str, job_id: int | None = None) -> Any:
    component = "host" if not device.isdigit() else "gpu"
    return {
        "component": component,
        "device": device,
        "job_id": job_id,
        "energy_j": energy_j,
        "source": source,
    }


def _power(at: datetime, readings: list[Any], interval_s: float = 5.0) -> Any:
    return {
        "sample_id": f"np-{uuid.uuid4().hex}",
        "at": at.isoformat(),
        "interval_s": interval_s,
        "readings": readings,
    }


def _charge(client: TestClient) -> None:
    app: Any = client.app
    config: GreenflowConfig = app.state.config
    with transaction(app.state.session_factory) as session:
        charge_new_telemetry(session, config)


def _ledger_j(client: TestClient, **where: Any) -> float:
    app: Any = client.app
    with transaction(app.state.session_factory) as session:
        stmt = select(func.coalesce(func.sum(LedgerEntry.energy_kwh), 0.0))
        for name, value in where.items():
            column = getattr(LedgerEntry, name)
            stmt = stmt.where(column.is_(None) if value is None else column == value)
        return float(session.scalar(stmt) or 0.0) * J_PER_KWH


def test_attribution_is_by_gpu_share_and_falls_to_the_cluster_without_jobs() -> None:
    assert attribution_shares({7: 3, 9: 1}) == {7: 0.75, 9: 0.25}
    assert attribution_shares({}) == {None: 1.0}


def test_idle_gpus_and_host_are_charged_and_add_up_to_what_the_nodes_reported(
    client: TestClient, tokens: Tokens
) -> None:
    assert _register(client, tokens.agent, "node-1", gpus=4).status_code == 200
    job_id = _submit(client, tokens)
    _place(client, job_id, "node-1")
    now = datetime.now(UTC).replace(microsecond=0)
    job_sample = _sample(job_id, at=(now - timedelta(seconds=10)).isoformat())
    job_j = job_sample["energy_kwh"] * J_PER_KWH
    # Interval 1: the job holds GPU 0 (measured by NVML), GPUs 1-3 idle, host from RAPL.
    busy = [
        _reading("0", 1234.5, "nvml", job_id),
        _reading("1", 301.25, "nvml"),
        _reading("2", 299.0, "nvml"),
        _reading("3", 300.5, "nvml"),
        _reading("package-0", 411.125, "rapl"),
        _reading("package-1", 388.0, "rapl"),
    ]
    # Interval 2: nothing runs; the node model estimates idle GPUs and the host.
    idle = [_reading(str(i), 60.0 * 5, "estimated") for i in range(4)]
    idle.append(_reading("host", 150.0 * 5, "estimated"))
    report = {
        "samples": [job_sample],
        "node_power": [_power(now - timedelta(seconds=5), busy), _power(now, idle)],
        "node": "node-1",
    }
    response = client.post("/v1/telemetry", json=report, headers=auth(tokens.agent))
    assert response.status_code == 200, response.text
    ack = response.json()
    assert (ack["stored"], ack["node_power_stored"], ack["node_power_rejected"]) == (1, 2, 0)
    # A retried report stores nothing twice.
    again = client.post("/v1/telemetry", json=report, headers=auth(tokens.agent)).json()
    assert (again["stored"], again["node_power_stored"], again["duplicates"]) == (0, 0, 3)

    spent_before = client.get("/v1/budget", headers=auth(tokens.operator)).json()
    assert spent_before["periods"][0]["spent_kg_co2e"] == 0.0
    _charge(client)

    idle_1 = 301.25 + 299.0 + 300.5
    host_1 = 411.125 + 388.0
    idle_2, host_2 = 4 * 300.0, 750.0
    # The busy GPU is charged once, from its job's telemetry; the node's reading of it is not.
    assert abs(_ledger_j(client, component="gpu") - job_j) < 1e-6
    # Interval 1's idle GPUs and host go to the only job on the node (it holds all busy GPUs).
    assert abs(_ledger_j(client, component="idle", job_id=job_id) - idle_1) < 1e-6
    assert abs(_ledger_j(client, component="host", job_id=job_id) - host_1) < 1e-6
    # Interval 2 had no job: the cluster's unattributed overhead, charged all the same.
    assert abs(_ledger_j(client, component="idle", job_id=None) - idle_2) < 1e-6
    assert abs(_ledger_j(client, component="host", job_id=None) - host_2) < 1e-6
    # Job-attributed plus unattributed equals what the node and the job reported.
    reported_j = job_j + idle_1 + host_1 + idle_2 + host_2
    attributed = _ledger_j(client, job_id=job_id)
    unattributed = _ledger_j(client, job_id=None)
    assert abs(attributed + unattributed - reported_j) < 1e-6
    # Sources are kept per entry; the budget now counts the idle and host energy too.
    app: Any = client.app
    with transaction(app.state.session_factory) as session:
        sources = set(session.scalars(select(LedgerEntry.power_source)))
        assert sources == {"estimated", "nvml", "rapl"}
        labels = set(session.scalars(select(LedgerEntry.intensity_source)))
        assert labels == {"conservative"}  # no intensity was recorded in this test
        assert all(s.charged for s in session.scalars(select(NodePowerSampleRow)))
    budget = client.get("/v1/budget", headers=auth(tokens.operator)).json()
    pue = GreenflowConfig().cluster.pue
    assert abs(budget["periods"][0]["energy_kwh"] - reported_j * pue / J_PER_KWH) < 1e-9
    assert budget["periods"][0]["spent_kg_co2e"] > 0
    # Charging again adds nothing.
    _charge(client)
    assert abs(_ledger_j(client) - reported_j) < 1e-6


def test_a_cluster_with_only_idle_gpus_is_charged(client: TestClient, tokens: Tokens) -> None:
    assert _register(client, tokens.agent, "node-1", gpus=2).status_code == 200
    now = datetime.now(UTC)
    readings = [_reading("0", 300.0, "estimated"), _reading("1", 300.0, "estimated")]
    body = {"samples": [], "node_power": [_power(now, readings)], "node": "node-1"}
    assert client.post("/v1/telemetry", json=body, headers=auth(tokens.agent)).status_code == 200
    _charge(client)
    assert abs(_ledger_j(client, component="idle", job_id=None) - 600.0) < 1e-6
    budget = client.get("/v1/budget", headers=auth(tokens.operator)).json()
    assert budget["periods"][0]["spent_kg_co2e"] > 0


def test_a_node_cannot_charge_other_jobs_or_gpus_it_lacks(
    client: TestClient, tokens: Tokens
) -> None:
    assert _register(client, tokens.agent, "node-1", gpus=2).status_code == 200
    job_id = _submit(client, tokens)  # never placed on node-1
    now = datetime.now(UTC)
    bad = [
        _power(now - timedelta(seconds=20), [_reading("0", 100.0, "nvml", job_id)]),
        _power(now - timedelta(seconds=10), [_reading("5", 100.0, "nvml")]),
        _power(now, [_reading("0", 1e9, "nvml")]),
    ]
    response = client.post(
        "/v1/telemetry",
        json={"samples": [], "node_power": bad, "node": "node-1"},
        headers=auth(tokens.agent),
    )
    assert response.status_code == 200, response.text
    assert response.json()["node_power_rejected"] == 3
    metrics = client.get("/metrics").text
    for reason in ("job_not_placed_here", "unknown_gpu", "above_node_maximum"):
        assert f'reason="node_power_{reason}"' in metrics
    _charge(client)
    assert _ledger_j(client) == 0.0


def test_the_planner_plans_only_into_what_the_nodes_overhead_leaves(
    client: TestClient, tokens: Tokens
) -> None:
    assert _register(client, tokens.agent, "node-1", gpus=2).status_code == 200
    now = datetime.now(UTC)
    # Two 5 s intervals: idle GPUs and host at 60 + 60 + 150 W, then 60 + 150 W (one GPU busy
    # with a job whose own telemetry charges it).
    first = [_reading("0", 300.0, "estimated"), _reading("1", 300.0, "estimated")]
    first.append(_reading("host", 750.0, "estimated"))
    second = [_reading("0", 300.0, "estimated"), _reading("host", 750.0, "estimated")]
    body = {
        "samples": [],
        "node_power": [_power(now - timedelta(seconds=5), first), _power(now, second)],
        "node": "node-1",
    }
    assert client.post("/v1/telemetry", json=body, headers=auth(tokens.agent)).status_code == 200
    app: Any = client.app
    config: GreenflowConfig = app.state.config
    with transaction(app.state.session_factory) as session:
        (status,) = periods_for_horizon(session, config, now, now + timedelta(minutes=5))
        power_w = (1350.0 + 1050.0) / 10.0
        seconds = (status.end_at - now).total_seconds()
        intensity = config.carbon.conservative_intensity_g_per_kwh  # no intensity recorded
        expected_kg = power_w * seconds / J_PER_KWH * config.cluster.pue * intensity / 1000
        assert status.reserved_kg == pytest.approx(expected_kg)
        assert status.left_kg == max(0.0, status.limit_kg - status.spent_kg - expected_kg)
        # The budget as reported (API, watchdog) keeps no reserve.
        assert current_period(session, config, now).reserved_kg == 0.0


def test_a_replays_carbon_clock_compresses_the_budget_periods_and_the_reserve(
    client: TestClient, tokens: Tokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The demo's clock: one series hour every 5 s, so a budget day lasts 120 s of wall time.
    wall0 = datetime.now(UTC)
    replay = ReplayClock(720.0, wall0, datetime(2021, 2, 27, 12, tzinfo=UTC))
    monkeypatch.setattr(periods, "_replay", replay)
    # 67 s in, the series is at 2021-02-28 01:24: its day started 12 h of series time (60 s)
    # after the anchor.
    day = period_containing(wall0 + timedelta(seconds=67), "day", "UTC", replay)
    assert (day.start_at, day.end_at) == (
        wall0 + timedelta(seconds=60),
        wall0 + timedelta(seconds=180),
    )
    parts = split_interval(day.end_at - timedelta(seconds=2), day.end_at + timedelta(seconds=3),
                           "day", "UTC", replay)  # fmt: skip
    assert [(hi - lo).total_seconds() for _, lo, hi in parts] == [2.0, 3.0]
    assert parts[1][0].start_at == day.end_at
    week = period_containing(day.start_at, "week", "UTC", replay)
    assert week.end_at - week.start_at == timedelta(seconds=840)
    assert _register(client, tokens.agent, "node-1", gpus=2).status_code == 200
    now = datetime.now(UTC)
    idle = [_reading("0", 300.0, "estimated"), _reading("1", 300.0, "estimated")]
    idle.append(_reading("host", 750.0, "estimated"))
    body = {"samples": [], "node_power": [_power(now, idle)], "node": "node-1"}
    assert client.post("/v1/telemetry", json=body, headers=auth(tokens.agent)).status_code == 200
    app: Any = client.app
    config: GreenflowConfig = app.state.config
    fast = config.model_copy(
        update={
            "carbon": config.carbon.model_copy(update={"clock_speedup": 720.0}),
            "budget": config.budget.model_copy(update={"period_clock": "carbon"}),
        }
    )
    with transaction(app.state.session_factory) as session:
        statuses = periods_for_horizon(session, fast, now, now + timedelta(seconds=120))
        # The horizon (one replay day) touches two 120 s periods; each reserves the overhead
        # until its own end, not until the wall clock's midnight.
        assert len(statuses) == 2
        first, second = statuses
        assert second.start_at == first.end_at
        assert second.end_at - second.start_at == timedelta(seconds=120)
        power_w = 1350.0 / 5.0
        per_s_kg = power_w / J_PER_KWH * fast.cluster.pue
        per_s_kg *= fast.carbon.conservative_intensity_g_per_kwh / 1000
        assert first.reserved_kg == pytest.approx(per_s_kg * (first.end_at - now).total_seconds())
        assert second.reserved_kg == pytest.approx(per_s_kg * 120.0)
        # The ledger charges into the same 120 s periods.
        charge_new_telemetry(session, fast)
        entry = session.scalars(select(LedgerEntry)).first()
        assert entry is not None
        assert entry.period_end - entry.period_start == timedelta(seconds=120)
