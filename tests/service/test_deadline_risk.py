"""A promised deadline the plan no longer keeps gets a deadline_at_risk event, once (issue 23)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from fastapi.testclient import TestClient

from scheduler_service.app import create_app
from scheduler_service.control_loop import ControlLoop
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import GpuSlot, Job, Node
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from scheduler_service.settings import GreenflowConfig, Settings
from tests.api.conftest import auth, database_url, make_tokens, postgres_server  # noqa: F401


def _config() -> GreenflowConfig:
    return GreenflowConfig.model_validate(
        {
            "carbon": {"provider": "synthetic"},
            "planner": {"slot_s": 600, "horizon_s": 14_400, "solver_time_limit_s": 1.0},
        }
    )


def test_a_deadline_the_plan_misses_is_reported_at_risk_once_and_back_on_track(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    tokens = make_tokens(database_url)
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = _config()
    now = utcnow()
    with transaction(factory) as session:
        node = Node(name="n1", agent_url="http://127.0.0.1:9", last_heartbeat_at=now)
        session.add(node)
        session.flush()
        session.add(GpuSlot(node_id=node.id, index=0))
        # Admitted earlier (its promise stands), but far more work than one GPU does in the
        # 20 minutes left: as after a node was lost.
        job = Job(
            owner="alice",
            name="promised",
            workload="resnet50",
            global_batch_size=256,
            total_samples=500_000_000,
            min_gpus=1,
            max_gpus=1,
            deadline_at=now + timedelta(minutes=20),
            state=JobState.QUEUED.value,
            state_reason="admitted: deadline can be met",
            created_at=now,
            updated_at=now,
        )
        session.add(job)
        session.flush()
        job_id = job.id

    async def ticks(count: int) -> None:
        # A loop per run: its agent client is closed at the end.
        loop = ControlLoop(config, factory, engine)
        try:
            for _ in range(count):
                await loop.tick()
        finally:
            await loop.agents.aclose()

    app = create_app(Settings(database_url=database_url, run_control_loop=False), config)
    try:
        asyncio.run(ticks(2))
        with TestClient(app) as client:
            events = client.get(f"/v1/jobs/{job_id}/events", headers=auth(tokens.alice)).json()
            risks = [e for e in events if e["kind"] == "deadline_at_risk"]
            # Two ticks that both miss it: one event, with the projected lateness.
            assert len(risks) == 1
            assert risks[0]["details"]["projected_lateness_s"] > 3_600
            assert "misses the deadline by" in risks[0]["reason"]
        with transaction(factory) as session:
            row = session.get(Job, job_id)
            assert row is not None
            row.deadline_at = utcnow() + timedelta(days=60)
        asyncio.run(ticks(1))
        with TestClient(app) as client:
            events = client.get(f"/v1/jobs/{job_id}/events", headers=auth(tokens.alice)).json()
            kinds = [e["kind"] for e in events if e["kind"].startswith("deadline_")]
            assert kinds == ["deadline_at_risk", "deadline_on_track"]
    finally:
        app.state.engine.dispose()
        engine.dispose()
