"""The control loop's health: its metrics on the app's /metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from scheduler_service.app import create_app
from scheduler_service.control_loop import ControlLoop
from scheduler_service.metrics import PLAN_STATUSES
from scheduler_service.settings import Settings
from tests.api.conftest import Tokens, auth, database_url, postgres_server, tokens  # noqa: F401
from tests.api.test_jobs_api import register_node, spec
from tests.service.test_budget_watchdog import _config, _FailingCarbon

LOOP = "greenflow_control_loop"


def _scrape(client: TestClient) -> dict[str, float]:
    """Every sample of the app's /metrics, keyed `name` or `name{label="value",...}`."""
    response = client.get("/metrics")
    assert response.status_code == 200
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def _scrape_until(
    client: TestClient, done: Callable[[dict[str, float]], bool], timeout_s: float = 30.0
) -> dict[str, float]:
    """Scrape until `done` holds for a scrape (the loop runs in the client's event-loop thread)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        samples = _scrape(client)
        if done(samples):
            return samples
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"no scrape matched within {timeout_s} s; last: {samples}")
        time.sleep(0.05)


def _plan_status(samples: dict[str, float]) -> str | None:
    """The status the last-plan series marks with 1 (None: the last tick planned no job)."""
    marked = [s for s in PLAN_STATUSES if samples[f'{LOOP}_last_plan_status{{status="{s}"}}'] == 1]
    assert len(marked) <= 1, samples
    return marked[0] if marked else None


def test_metrics_show_the_loops_ticks_failures_and_last_plan(
    database_url: str,  # noqa: F811 (fixture)
    tokens: Tokens,  # noqa: F811 (fixture)
) -> None:
    # Slot 300 s, watchdog every 60 s: within the test only events and the 0.2 s backoff tick.
    config = _config(limit_kg=1.0, tick_retry_initial_s=0.2)
    app = create_app(Settings(database_url=database_url, run_control_loop=True), config)
    loop = app.state.control_loop
    assert isinstance(loop, ControlLoop)
    # The loop's first tick fails (its forecast raises); the retry after the backoff works.
    configured = loop.carbon
    loop.carbon = _FailingCarbon(config, failures=1)
    asyncio.run(configured.aclose())
    before_s = datetime.now(UTC).timestamp()
    try:
        with TestClient(app) as client:
            first = _scrape_until(client, lambda m: m.get(f"{LOOP}_ticks_total") == 1)
            assert first[f"{LOOP}_tick_failures_total"] == 1
            assert first[f"{LOOP}_stale_replans_total"] == 0
            assert first[f"{LOOP}_budget_wakes_total"] == 0
            assert first[f"{LOOP}_leader"] == 1
            assert first[f"{LOOP}_last_tick_duration_seconds"] > 0
            ended_s = first[f"{LOOP}_last_tick_timestamp_seconds"]
            assert before_s <= ended_s <= datetime.now(UTC).timestamp()
            # No job yet: no plan, so every status is 0 and there is no gap or solve time.
            assert first[f"{LOOP}_last_tick_jobs_planned"] == 0
            assert _plan_status(first) is None
            assert f"{LOOP}_last_plan_gap_ratio" not in first
            assert f"{LOOP}_last_plan_solve_seconds" not in first

            # A node (its agent unreachable: delivery fails, the tick still completes) and a
            # job: each wakes the loop, and a tick plans the job.
            register_node(client, tokens)
            submitted = client.post("/v1/jobs", json=spec(), headers=auth(tokens.alice))
            assert submitted.status_code == 201, submitted.text
            second = _scrape_until(client, lambda m: m[f"{LOOP}_last_tick_jobs_planned"] == 1)
            # The series describe the plan that tick stored (nothing wakes the loop after it).
            plan = client.get("/v1/plan", headers=auth(tokens.operator)).json()
            assert _plan_status(second) == plan["status"]
            assert second.get(f"{LOOP}_last_plan_gap_ratio") == plan["gap"]
            assert second[f"{LOOP}_last_plan_solve_seconds"] == pytest.approx(plan["solve_s"])
            assert second[f"{LOOP}_ticks_total"] >= 2
            assert second[f"{LOOP}_tick_failures_total"] == 1
            assert second[f"{LOOP}_last_tick_timestamp_seconds"] >= ended_s
    finally:
        app.state.engine.dispose()


def test_metrics_leave_out_the_loop_where_it_does_not_run(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    app = create_app(Settings(database_url=database_url, run_control_loop=False), _config(1.0))
    try:
        with TestClient(app) as client:
            samples = _scrape(client)
        assert "greenflow_gpus_total" in samples
        assert not [name for name in samples if name.startswith(LOOP)]
    finally:
        app.state.engine.dispose()
