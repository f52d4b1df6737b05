"""Carbon reports, budget metrics and the Grafana dashboard (issue 22): `GET /v1/report`,
`greenflow report`, the console's download and `/metrics` show the same ledger."""

from __future__ import annotations

import csv
import io
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from scheduler_service import cli
from scheduler_service.budget.report import COLUMNS, UNATTRIBUTED, csv_from_json, parse_period
from scheduler_service.client import GreenflowClient
from scheduler_service.exceptions import GreenflowError
from tests.api.conftest import Tokens, auth
from tests.api.test_node_identity import _place, _register, _sample, _submit
from tests.browser.test_console_http import sign_in
from tests.budget.test_node_power import _charge, _power, _reading

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "greenflow-carbon.json"
J_PER_KWH = 3.6e6


def test_periods_are_months_or_days() -> None:
    start, end = parse_period("2026-11")
    assert (start, end) == (datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC))
    assert parse_period("2026-12")[1] == datetime(2027, 1, 1, tzinfo=UTC)
    assert parse_period("2026-02-28")[1] == datetime(2026, 3, 1, tzinfo=UTC)
    for bad in ("2026", "2026-13", "2026-11-31", "nov"):
        with pytest.raises(GreenflowError):
            parse_period(bad)


def _seed(client: TestClient, tokens: Tokens) -> tuple[int, int]:
    """Two jobs on a 4-GPU node: job A (queue "a") on GPU 0 with NVML power, job B (queue "b")
    on GPUs 1-2 with estimated power; GPU 3 idle; then an interval with no job."""
    assert _register(client, tokens.agent, "node-1", gpus=4).status_code == 200
    job_a = _submit(client, tokens, queue="a")
    job_b = _submit(client, tokens, queue="b")
    _place(client, job_a, "node-1")
    _place(client, job_b, "node-1")
    now = datetime.now(UTC).replace(microsecond=0)
    samples = [
        _sample(job_a, power_w=360.0, energy_kwh=1800.0 / J_PER_KWH, power_source="nvml"),
        _sample(job_b, power_w=720.0, energy_kwh=3600.0 / J_PER_KWH, gpus=2),
    ]
    busy = [
        _reading("0", 1800.0, "nvml", job_a),
        _reading("1", 1800.0, "nvml", job_b),
        _reading("2", 1800.0, "nvml", job_b),
        _reading("3", 300.0, "nvml"),
        _reading("package-0", 600.0, "rapl"),
    ]
    empty = [_reading(str(i), 300.0, "estimated") for i in range(4)]
    empty.append(_reading("host", 750.0, "estimated"))
    body = {
        "samples": samples,
        "node_power": [_power(now - timedelta(seconds=5), busy), _power(now, empty)],
        "node": "node-1",
    }
    response = client.post("/v1/telemetry", json=body, headers=auth(tokens.agent))
    assert response.status_code == 200 and response.json()["node_power_stored"] == 2
    _charge(client)
    return job_a, job_b


def test_report_per_job_queue_and_user_in_json_csv_cli_and_console(
    client: TestClient, tokens: Tokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_a, job_b = _seed(client, tokens)
    period = datetime.now(UTC).strftime("%Y-%m")
    ops = auth(tokens.operator)
    data = client.get("/v1/report", params={"period": period, "by": "job"}, headers=ops).json()
    assert data["columns"] == list(COLUMNS)
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == [str(job_a), str(job_b), UNATTRIBUTED]
    pue = 1.2
    a, b, cluster = rows[str(job_a)], rows[str(job_b)], rows[UNATTRIBUTED]
    # GPU energy from each job's telemetry; interval 1's idle GPU 3 (300 J) and host (600 J)
    # split by GPU share: A holds 1 of 3 busy GPUs, B 2.
    assert a["gpu_energy_kwh"] == pytest.approx(1800.0 / J_PER_KWH)
    assert a["idle_energy_kwh"] == pytest.approx(100.0 / J_PER_KWH)
    assert a["host_energy_kwh"] == pytest.approx(200.0 / J_PER_KWH)
    assert b["idle_energy_kwh"] == pytest.approx(200.0 / J_PER_KWH)
    assert b["host_energy_kwh"] == pytest.approx(400.0 / J_PER_KWH)
    assert cluster["gpu_energy_kwh"] == 0.0
    assert cluster["idle_energy_kwh"] == pytest.approx(1200.0 / J_PER_KWH)
    assert cluster["host_energy_kwh"] == pytest.approx(750.0 / J_PER_KWH)
    it_a = (1800.0 + 100.0 + 200.0) / J_PER_KWH
    assert a["pue_overhead_kwh"] == pytest.approx(it_a * (pue - 1))
    assert a["energy_kwh"] == pytest.approx(it_a * pue)
    # A: all measured (NVML, RAPL); B: its GPU estimate is not measured, its share of the
    # idle GPU (NVML) and host (RAPL) is; the cluster row: all estimated.
    assert a["measured_share"] == pytest.approx(1.0)
    assert b["measured_share"] == pytest.approx(600.0 / 4200.0)
    assert cluster["measured_share"] == 0.0
    assert all(r["emissions_kg"] > 0 for r in rows.values())
    # No intensity was recorded: every row says it was charged at the conservative fallback.
    assert {(r["intensity_source"], r["fallback_intensity"]) for r in rows.values()} == {
        ("conservative", True)
    }
    total = data["total"]
    reported_j = 1800 + 3600 + 300 + 600 + 1200 + 750
    it_total = total["gpu_energy_kwh"] + total["idle_energy_kwh"] + total["host_energy_kwh"]
    assert it_total * J_PER_KWH == pytest.approx(reported_j, abs=1e-6)
    assert total["emissions_kg"] == pytest.approx(sum(r["emissions_kg"] for r in rows.values()))
    assert data["caveats"] and "Location-based" in data["caveats"][0]

    by_queue = client.get("/v1/report", params={"period": period, "by": "queue"}, headers=ops)
    assert [r["key"] for r in by_queue.json()["rows"]] == ["a", "b", UNATTRIBUTED]
    by_user = client.get("/v1/report", params={"period": period, "by": "user"}, headers=ops)
    assert [r["key"] for r in by_user.json()["rows"]] == ["alice", UNATTRIBUTED]
    # A user sees only their own jobs' rows (Bob has none; no cluster overhead either).
    bobs = client.get("/v1/report", params={"period": period}, headers=auth(tokens.bob)).json()
    assert bobs["rows"] == [] and bobs["total"]["emissions_kg"] == 0.0
    # Another month has nothing; a bad period is a 400 naming the format.
    assert client.get("/v1/report", params={"period": "2020-01"}, headers=ops).json()["rows"] == []
    bad = client.get("/v1/report", params={"period": "2026-13"}, headers=ops)
    assert bad.status_code == 400 and "YYYY-MM" in bad.json()["detail"]

    # CSV from the API, the console's download and the CLI: the same bytes.
    params = {"period": period, "by": "job", "format": "csv"}
    api_csv = client.get("/v1/report", params=params, headers=ops)
    assert api_csv.headers["content-type"].startswith("text/csv")
    assert "attachment" in api_csv.headers["content-disposition"]
    assert api_csv.text == csv_from_json(data)
    parsed = list(csv.DictReader(io.StringIO(api_csv.text)))
    assert [r["key"] for r in parsed] == [str(job_a), str(job_b), UNATTRIBUTED, "total"]
    sign_in(client, tokens.operator)
    console = client.get("/console/report", params=params)
    assert console.status_code == 200 and console.text == api_csv.text

    def api_client() -> GreenflowClient:
        wrapped = GreenflowClient("http://testserver", tokens.operator)
        in_process: Any = client  # an httpx client whose calls go to the app in this process
        wrapped._http = in_process
        client.headers["Authorization"] = f"Bearer {tokens.operator}"
        return wrapped

    monkeypatch.setattr(cli, "_client", api_client)
    monkeypatch.setattr(GreenflowClient, "close", lambda self: None)
    runner = CliRunner()
    result = runner.invoke(cli.app, ["report", "--period", period, "--by", "job"])
    assert result.exit_code == 0, result.output
    assert result.output == api_csv.text
    as_json = runner.invoke(cli.app, ["report", "--period", period, "--format", "json"])
    assert as_json.exit_code == 0 and json.loads(as_json.output)["rows"] == data["rows"]
    wrong = runner.invoke(cli.app, ["report", "--period", period, "--by", "team"])
    assert wrong.exit_code == 2


def _scrape(client: TestClient) -> dict[str, float]:
    """{series with labels: value} of /metrics."""
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def test_budget_metrics_show_the_ledger(client: TestClient, tokens: Tokens) -> None:
    _seed(client, tokens)
    scraped = _scrape(client)
    budget = client.get("/v1/budget", headers=auth(tokens.operator)).json()
    period = budget["periods"][0]
    assert scraped['greenflow_budget_emissions_kg{budget="cluster"}'] == pytest.approx(
        period["spent_kg_co2e"]
    )
    assert scraped['greenflow_budget_limit_kg{budget="cluster"}'] == budget["limit_kg_co2e"]
    energy = sum(
        scraped[f'greenflow_budget_energy_kwh{{budget="cluster",component="{c}"}}']
        for c in ("gpu", "idle", "host")
    )
    assert energy == pytest.approx(period["energy_kwh"])
    idle = scraped['greenflow_ledger_energy_kwh_total{component="idle"}']
    assert idle == pytest.approx((300.0 + 1200.0) * 1.2 / J_PER_KWH)


def test_grafana_dashboard_parses_and_uses_only_exported_metrics(
    client: TestClient, tokens: Tokens
) -> None:
    _seed(client, tokens)
    exported: set[str] = set()
    # Every family the service declares, samples or not (a labelled counter has none until
    # its first increment); a counter's samples carry the `_total` suffix.
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            base = name.removesuffix("_total")
            exported |= {name, base + "_total"} if kind == "counter" else {name}
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [
        v["query"]["query"]
        for v in dashboard["templating"]["list"]
        if isinstance(v.get("query"), dict)
    ]
    used = {name for expr in exprs for name in re.findall(r"\bgreenflow_[a-z0-9_]+", expr)}
    assert used, "the dashboard queries no GreenFlow series"
    assert used <= exported, f"not exported: {sorted(used - exported)}"
    assert {"greenflow_budget_emissions_kg", "greenflow_ledger_energy_kwh_total"} <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
