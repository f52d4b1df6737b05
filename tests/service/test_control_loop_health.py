"""The control loop's health: its metrics on the app's /metrics, and the bound on re-plans when jobs
keep changing under a tick (StaleDataError)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event, update
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from scheduler_service.app import create_app
from scheduler_service.control_loop import STALE_REPLANS_AT_ONCE, ControlLoop
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import GpuSlot, Job, Node, Plan
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from scheduler_service.metrics import PLAN_STATUSES
from scheduler_service.settings import Settings
from tests.api.conftest import Tokens, auth, database_url, postgres_server, tokens  # noqa: F401
from tests.api.test_jobs_api import register_node, spec
from tests.service.test_budget_watchdog import (
    _add_job,
    _config,
    _FailingCarbon,
    _retry_delays_s,
    _tick_failures,
    _until,
)

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
            # Each phase of the tick has its time, and together they are no more than the tick.
            phases = {
                name: second[f'{LOOP}_last_tick_phase_seconds{{phase="{name}"}}']
                for name in ("snapshot", "solve", "write", "dispatch")
            }
            assert all(seconds >= 0 for seconds in phases.values())
            assert sum(phases.values()) <= second[f"{LOOP}_last_tick_duration_seconds"]
            # The tick thread's CPU in a phase is part of that phase's time, never more (a
            # little slack: the two clocks are read one after the other).
            for name in ("snapshot", "models", "write"):
                cpu_s = second[f'{LOOP}_last_tick_phase_cpu_seconds{{phase="{name}"}}']
                wall_s = second[f'{LOOP}_last_tick_phase_seconds{{phase="{name}"}}']
                assert 0 < cpu_s <= wall_s + 0.01
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


def _queued_job(factory: sessionmaker[Session]) -> int:
    """A queued job with work left, as submission leaves it."""
    return _add_job(
        factory,
        name="queued",
        total_samples=1_000_000,
        state=JobState.QUEUED.value,
        state_reason="submitted",
    )


def test_a_job_that_keeps_changing_fails_the_tick_after_a_few_immediate_replans(
    database_url: str,  # noqa: F811 (fixture)
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    # A queued job and no node: every plan rewrites its state_reason ("needs ... GPUs").
    job_id = _queued_job(factory)
    # The backoff is a whole slot: only a wake can bring a tick after the first failure.
    config = _config(limit_kg=1.0, tick_retry_initial_s=300)
    loop = ControlLoop(config, factory, engine)
    conflicts: list[int] = []
    changing = True

    def another_writer(session: Session, _context: Any, _instances: Any) -> None:
        # Just before the loop writes a job, another writer commits a change to it: the
        # loop's UPDATE ... WHERE version = <read> then matches no row (StaleDataError).
        # Same connection, so it works on SQLite too, where a second writer would block.
        if not changing:
            return
        for job in [o for o in session.dirty if isinstance(o, Job)]:
            session.connection().execute(
                update(Job).where(Job.id == job.id).values(version=Job.version + 1)
            )
            conflicts.append(job.id)

    event.listen(factory, "before_flush", another_writer)

    async def run() -> tuple[int, int]:
        nonlocal changing
        loop._loop = asyncio.get_running_loop()
        ticking = asyncio.create_task(loop._tick_forever())
        try:
            # Before the bound, the loop planned again at once forever and never failed a tick.
            await _until(lambda: len(_tick_failures(caplog)) == 1)
            at_failure = len(conflicts)
            # The job stops changing; a wake cuts the backoff short and the tick works.
            changing = False
            loop.wake()
            await _until(lambda: loop.ticks == 1)
            return at_failure, len(conflicts)
        finally:
            await loop.stop()
            await ticking

    try:
        at_failure, in_all = asyncio.run(run())
        # The first conflict and the next ones up to the bound re-planned at once; one more
        # failed the tick, which then waited for the backoff (or a wake), not planning meanwhile.
        assert at_failure == in_all == STALE_REPLANS_AT_ONCE + 1
        assert set(conflicts) == {job_id}
        assert loop.stale_replans == STALE_REPLANS_AT_ONCE + 1
        assert loop.tick_failures == 1
        assert _retry_delays_s(caplog) == pytest.approx([300.0])
        failure = _tick_failures(caplog)[0]
        assert failure.exc_info is not None and isinstance(failure.exc_info[1], StaleDataError)
        assert any("backing off" in r.getMessage() for r in caplog.records)
        # The tick after the wake committed its plan: the job's reason is the planner's.
        with transaction(factory) as session:
            job = session.get(Job, job_id)
            assert job is not None and "GPUs" in (job.state_reason or "")
    finally:
        engine.dispose()


def test_a_plan_whose_commit_fails_is_not_taken_for_the_plan_in_force(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    with transaction(factory) as session:
        node = Node(name="n1", agent_url="http://127.0.0.1:9", last_heartbeat_at=utcnow())
        session.add(node)
        session.flush()
        for index in range(4):
            session.add(GpuSlot(node_id=node.id, index=index))
    _queued_job(factory)
    loop = ControlLoop(_config(limit_kg=1.0), factory, engine)
    failing = True

    def another_writer(session: Session, _context: Any, _instances: Any) -> None:
        # The planning transaction fails after its plan is made and staged, as when another
        # writer changed a row it updates (no versioned row is updated there on this setup, so
        # the conflict is raised as the ORM would raise it, at the next flush).
        if failing and session.info.get("planned"):
            raise StaleDataError("another writer changed a row this tick updates")
        if any(isinstance(o, Plan) for o in session.new):
            session.info["planned"] = True

    event.listen(factory, "before_flush", another_writer)

    async def run() -> tuple[object, object]:
        nonlocal failing
        try:
            with pytest.raises(StaleDataError):
                await loop.tick()
            in_force = (loop.previous, loop._spend_expectation)
            failing = False
            await loop.tick()
            return in_force
        finally:
            await loop.agents.aclose()

    try:
        previous, expectation = asyncio.run(run())
        # Nothing was stored, so nothing new is in force: no warm start from the unstored plan,
        # no spend expectation of it for the watchdog.
        assert previous is None and expectation is None
        # The tick that committed took its plan for the one in force.
        assert loop.previous is not None and loop._spend_expectation is not None
    finally:
        engine.dispose()


def test_a_burst_of_wakes_is_served_by_about_one_tick_a_second(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    loop = ControlLoop(_config(limit_kg=1.0), factory, engine)
    coalesce_s = loop.config.planner.wake_coalesce_s

    async def run() -> tuple[int, float]:
        loop._loop = asyncio.get_running_loop()
        ticking = asyncio.create_task(loop._tick_forever())
        try:
            await _until(lambda: loop.ticks == 1)
            began_s = time.monotonic()
            # 40 submissions in a second, each waking the loop, as the API does.
            for _ in range(40):
                loop.wake()
                await asyncio.sleep(0.025)
            await _until(lambda: loop.ticks >= 2)
            spent_s = time.monotonic() - began_s
            return loop.ticks - 1, spent_s
        finally:
            await loop.stop()
            await ticking

    try:
        woken, spent_s = asyncio.run(run())
        # The wakes were served (a tick came), by at most one tick per coalescing interval
        # (before it, a tick per wake: 40).
        assert 1 <= woken <= spent_s / coalesce_s + 1
    finally:
        engine.dispose()
