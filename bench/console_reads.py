"""Console and plan reads at cluster scale: time and SQL statements per view (JSON out).

Seeds a fresh database with N jobs (5 % running with telemetry, 2 % past their deadline,
1 % that the plan says will miss theirs, the rest queued with a later deadline or finished), two
events each and a current plan of all unfinished jobs over 48 slots, then times each view as the
console serves it (HTTP through the app, signed in as an operator; median of `--repeat`) and
counts its SQL statements.

Usage:
    python -m bench.console_reads [--postgres-url URL | --sqlite] [--jobs 1000,10000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, insert, select

from bench.api_load import commit, fresh_database
from scheduler_service.app import create_app
from scheduler_service.auth.service import create_token
from scheduler_service.auth.tokens import Role
from scheduler_service.db import migrate
from scheduler_service.db.models import Job, JobEvent, Node, Plan, TelemetrySample
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.settings import GreenflowConfig, Settings

DEFAULT_URL = os.environ.get(
    "GREENFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
SLOTS = 48


def seed(engine: Engine, n_jobs: int, now: datetime) -> tuple[str, int]:
    """N jobs, their events and telemetry and a current plan; returns an operator token and a job id."""
    factory = make_session_factory(engine)
    with transaction(factory) as session:
        token = create_token(session, name="ops", role=Role.OPERATOR)
        session.add(Node(name="n1", agent_url="http://127.0.0.1:1"))
    rows = []
    for i in range(n_jobs):
        share = i % 100
        state = (
            "RUNNING" if share < 5 else "SUCCEEDED" if share >= 80 else "QUEUED"
        )  # 5 % running, 20 % done
        late = 5 <= share < 7
        rows.append(
            {
                "owner": f"user{i % 20}",
                "name": f"job-{i}",
                "workload": "gpt2",
                "global_batch_size": 64,
                "total_samples": 6_400_000,
                "min_gpus": 1,
                "max_gpus": 8,
                "deadline_at": now + (timedelta(hours=-1) if late else timedelta(hours=6)),
                "state": state,
                "state_reason": "seeded",
                "current_gpus": 2 if state == "RUNNING" else 0,
                "created_at": now - timedelta(hours=2),
                "updated_at": now - timedelta(hours=2),
                "version": 1,
            }
        )
    with engine.begin() as conn:
        conn.execute(insert(Job), rows)
    with transaction(factory) as session:
        jobs = list(session.execute(select(Job.id, Job.state)))
        events = [
            {"job_id": job_id, "at": now - timedelta(minutes=k), "kind": "state", "to_state": st}
            for job_id, st in jobs
            for k in (1, 2)
        ]
        session.execute(insert(JobEvent), events)
        samples = [
            {
                "sample_id": f"s{job_id}-{k}",
                "job_id": job_id,
                "at": now - timedelta(seconds=10 * (10 - k)),
                "interval_s": 10.0,
                "step": k,
                "samples_done": 640 * k,
                "samples_per_s": 64.0,
                "gpus": 2,
                "power_w": 500.0,
                "energy_kwh": 0.001,
                "power_source": "estimated",
            }
            for job_id, st in jobs
            if st == "RUNNING"
            for k in range(10)
        ]
        session.execute(insert(TelemetrySample), samples)
        unfinished = [job_id for job_id, st in jobs if st != "SUCCEEDED"]
        AllocationRepository(session).add_plan(
            Plan(
                start_at=now,
                slot_s=600.0,
                policy="greenflow",
                status="OPTIMAL",
                gap=0.0,
                solve_s=1.0,
                energy_kwh=1.0,
                emissions_kg=0.1,
                slots=[{"capacity_gpus": 2048, "intensity_g_per_kwh": 200.0}] * SLOTS,
            ),
            {str(j): [j % 3] * SLOTS for j in unfinished},
            {str(j): "not enough GPUs" for j in unfinished if j % 100 == 50},
        )
    return token, jobs[0][0]


def measure(client: TestClient, engine: Engine, path: str, repeat: int) -> dict[str, Any]:
    """Median and best milliseconds of GET `path`, and the statements one view runs."""
    statements: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        statements.append(statement)

    assert client.get(path).status_code == 200, path  # warm
    event.listen(engine, "before_cursor_execute", record)
    try:
        client.get(path)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        response = client.get(path)
        times.append(time.perf_counter() - start)
        assert response.status_code == 200, path
    return {
        "path": path,
        "ms_median": round(1000 * statistics.median(times), 1),
        "ms_best": round(1000 * min(times), 1),
        "statements": len(statements),
        "bytes": len(response.content),
    }


def run_case(url: str, n_jobs: int, repeat: int) -> dict[str, Any]:
    """All views at one database size."""
    migrate.upgrade(url)
    engine = make_engine(url)
    now = datetime.now(UTC)
    started = time.perf_counter()
    token, job_id = seed(engine, n_jobs, now)
    seed_s = time.perf_counter() - started
    engine.dispose()
    app = create_app(Settings(database_url=url, run_control_loop=False), GreenflowConfig())
    views = []
    with TestClient(app) as client:
        signed_in = client.post("/console/login", data={"token": token}, follow_redirects=False)
        assert signed_in.status_code == 303, signed_in.text
        app_engine = app.state.engine
        for path in ("/console", "/console/carbon", f"/console/jobs/{job_id}"):
            views.append(measure(client, app_engine, path, repeat))
        client.cookies.clear()
        client.headers["Authorization"] = f"Bearer {token}"
        for path in ("/v1/plan", f"/v1/plan?job={job_id}"):
            views.append(measure(client, app_engine, path, repeat))
    app.state.engine.dispose()
    return {"jobs": n_jobs, "seed_s": round(seed_s, 1), "views": views}


def main() -> None:
    """Seed, time and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=DEFAULT_URL)
    parser.add_argument("--sqlite", action="store_true", help="Use a SQLite file instead.")
    parser.add_argument("--jobs", default="1000,10000")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    cases = []
    for n_jobs in (int(n) for n in args.jobs.split(",")):
        if args.sqlite:
            with tempfile.TemporaryDirectory() as tmp:
                cases.append(
                    run_case(f"sqlite:///{tmp}/{uuid.uuid4().hex}.db", n_jobs, args.repeat)
                )
        else:
            with fresh_database(args.postgres_url, "gf_console_bench") as url:
                cases.append(run_case(url, n_jobs, args.repeat))
    backend = "sqlite" if args.sqlite else "postgresql"
    setup = {"commit": commit(), "backend": backend, "load_1min": round(os.getloadavg()[0], 2)}
    print(json.dumps({"cases": cases, "setup": setup}, indent=2))


if __name__ == "__main__":
    main()
