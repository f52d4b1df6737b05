"""The control loop's tick in-process on PostgreSQL, phase by phase (JSON out; no server, no API).

A fresh database with `--nodes` ready nodes of `--gpus` GPU slots and `--jobs` queued jobs
(submitted as the API stores them: the job and its two events), then `--ticks` calls of
`ControlLoop._plan` (snapshot, models, solve in this thread, write). The first tick is the one
after a burst of submissions: every job new, read, planned, deferred and given an event.
Between ticks every command is acknowledged as an agent would (`ControlLoop._record`), each
job holding slots reports `--telemetry-rounds` samples per node (the telemetry service's
`ingest`), and `--more-jobs` more are queued. Per tick: wall and CPU seconds of each phase, the
statements run, commands to deliver, refits so far. `--profile DIR` writes each tick's cProfile
there (`tickN.prof`).

Usage:
    python -m bench.tick_phases [--jobs 5000] [--nodes 256] [--gpus 8] [--ticks 3]
        [--more-jobs 0] [--telemetry-rounds 2] [--postgres-url URL] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import event, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from bench.api_load import DEFAULT_URL, commit, fresh_database
from scheduler_service.control_loop import ControlLoop, _Outcome
from scheduler_service.db import migrate
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, GpuSlot, Node
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import JobState, submission_events
from scheduler_service.settings import GreenflowConfig
from scheduler_service.telemetry.service import TelemetryLimits, ingest
from worker_agent.protocol import (
    AllocationAck,
    AllocationCommand,
    TelemetryReport,
    TelemetrySample,
)

# The load agent's synthetic speed and power of one GPU (bench/load_agent.py).
SAMPLES_PER_S_PER_GPU = 400.0
POWER_W_PER_GPU = 300.0
TELEMETRY_S = 5.0


def queue_jobs(factory: sessionmaker[Session], count: int) -> None:
    """`count` queued jobs as a submission stores them (1-8 GPUs, far more work than a run)."""
    now = utcnow()
    with transaction(factory) as session:
        jobs = JobRepository(session)
        for _ in range(count):
            jobs.insert_submitted(
                {
                    "owner": "alice",
                    "state": JobState.QUEUED.value,
                    "state_reason": "accepted; waiting for the planner",
                    "created_at": now,
                    "updated_at": now,
                    "version": 1,
                    "name": "scale",
                    "workload": "resnet50",
                    "global_batch_size": 256,
                    "total_samples": 10**12,
                    "min_gpus": 1,
                    "max_gpus": 8,
                    "submission_id": uuid.uuid4().hex,
                },
                submission_events(at=now, submitter="alice", reason="accepted"),
            )


def add_nodes(loop: ControlLoop, nodes: int, gpus: int) -> None:
    """Ready nodes registered under the loop's scheduler key, each with `gpus` slots."""
    now = utcnow()
    with transaction(loop.session_factory) as session:
        for index in range(nodes):
            node = Node(
                name=f"node-{index:03d}",
                agent_url=f"http://127.0.0.1:9/n/node-{index:03d}",
                registered_at=now,
                state="ready",
                last_heartbeat_at=now,
                secret_key_id=loop.node_secrets.key_id,
                agent_secret_nonce=loop.node_secrets.new_nonce(),
            )
            session.add(node)
            session.flush()
            session.add_all(GpuSlot(node_id=node.id, index=slot) for slot in range(gpus))


def acknowledge_all(loop: ControlLoop) -> int:
    """Answer every command to deliver as an agent that applied it; how many there were."""
    outcomes = []
    for delivery in loop._deliveries():
        command = delivery.command
        ack = None
        if isinstance(command, AllocationCommand):
            gpus = len(command.slot_indices)
            ack = AllocationAck(
                job_id=command.job_id,
                generation=command.generation,
                gpus=gpus,
                layout=f"dp{gpus}" if gpus else None,
                step=0,
                worker_pids=[],
                resumed_from="start" if gpus else None,
            )
        outcomes.append(_Outcome(delivery.allocation_id, ack, None))
    for begin in range(0, len(outcomes), 200):
        loop._record(outcomes[begin : begin + 200])
    with transaction(loop.session_factory) as session:
        session.execute(update(Node).values(last_heartbeat_at=utcnow()))
    return len(outcomes)


def report_telemetry(loop: ControlLoop, rounds: int, counter: list[int]) -> int:
    """`rounds` samples of every job holding slots, one report per node and round; stored."""
    limits = TelemetryLimits(1500.0, 20.0, 30.0)
    with transaction(loop.session_factory) as session:
        held = session.execute(
            select(Node.name, GpuSlot.job_id, func.count())
            .join(GpuSlot, GpuSlot.node_id == Node.id)
            .where(GpuSlot.job_id.is_not(None))
            .group_by(Node.name, GpuSlot.job_id)
        ).all()
        generations = dict(
            session.execute(
                select(Allocation.job_id, func.max(Allocation.generation))
                .where(Allocation.status == "acked")
                .group_by(Allocation.job_id)
            ).all()
        )
    by_node: dict[str, list[tuple[int, int]]] = {}
    for name, job_id, gpus in held:
        if job_id is not None:  # the query reads held slots only
            by_node.setdefault(name, []).append((job_id, gpus))
    done: dict[int, int] = {}
    stored = 0
    for index in range(rounds):
        at = datetime.now(UTC) - timedelta(seconds=TELEMETRY_S * (rounds - index))
        for name, jobs in by_node.items():
            samples = []
            for job_id, gpus in jobs:
                rate = SAMPLES_PER_S_PER_GPU * gpus
                done[job_id] = done.get(job_id, 0) + int(rate * TELEMETRY_S)
                counter[0] += 1
                samples.append(
                    TelemetrySample(
                        sample_id=f"{name}-{job_id}-{counter[0]}",
                        job_id=job_id,
                        generation=generations.get(job_id, 1),
                        at=at,
                        interval_s=TELEMETRY_S,
                        step=counter[0],
                        samples_done=done[job_id],
                        samples_per_s=rate,
                        gpus=gpus,
                        layout=f"dp{gpus}",
                        power_w=POWER_W_PER_GPU * gpus,
                        energy_kwh=POWER_W_PER_GPU * gpus * TELEMETRY_S / 3.6e6,
                        power_source="estimated",
                    )
                )
            with transaction(loop.session_factory) as session:
                report = TelemetryReport(samples=samples, node=name)
                stored += ingest(session, name, report, limits).stored
    return stored


def run(args: argparse.Namespace, database_url: str) -> list[dict[str, Any]]:
    """The ticks' figures."""
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = GreenflowConfig.model_validate(
        {
            "planner": {"slot_s": 300, "horizon_s": 86_400, "solver_process": False},
            "cluster": {"heartbeat_timeout_s": 60},
        }
    )
    loop = ControlLoop(config, factory, engine)
    statements = [0]

    def count(*_args: Any) -> None:
        statements[0] += 1

    event.listen(engine, "before_cursor_execute", count)
    rows: list[dict[str, Any]] = []
    try:
        add_nodes(loop, args.nodes, args.gpus)
        queue_jobs(factory, args.jobs)
        counter = [0]
        for tick in range(1, args.ticks + 1):
            forecast = asyncio.run(loop.carbon.get_forecast(config.planner.horizon_s))
            phases_s: dict[str, float] = {}
            phases_cpu_s: dict[str, float] = {}
            statements[0] = 0
            profile = cProfile.Profile() if args.profile else None
            began_s = time.perf_counter()
            if profile is not None:
                profile.enable()
            planned, _ = loop._plan(forecast, utcnow(), phases_s, phases_cpu_s)
            if profile is not None:
                profile.disable()
                profile.dump_stats(str(Path(args.profile) / f"tick{tick}.prof"))
            row: dict[str, Any] = {
                "tick": tick,
                "jobs_planned": planned,
                "plan_s": round(time.perf_counter() - began_s, 3),
                "statements": statements[0],
                **{f"{name}_s": round(value, 3) for name, value in phases_s.items()},
                **{f"{name}_cpu_s": round(value, 3) for name, value in phases_cpu_s.items()},
                "commands": len(loop._deliveries()),
                "refits": loop.models.refits,
            }
            rows.append(row)
            if tick < args.ticks:
                row["acknowledged_after"] = acknowledge_all(loop)
                row["samples_after"] = report_telemetry(loop, args.telemetry_rounds, counter)
                queue_jobs(factory, args.more_jobs)
    finally:
        asyncio.run(loop.carbon.aclose())
        asyncio.run(loop.agents.aclose())
        engine.dispose()
    return rows


def main() -> None:
    """Run the ticks and print the JSON figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=DEFAULT_URL)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=3)
    parser.add_argument("--more-jobs", type=int, default=0)
    parser.add_argument("--telemetry-rounds", type=int, default=2)
    parser.add_argument("--profile", default="", help="write each tick's cProfile here")
    args = parser.parse_args()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    with fresh_database(args.postgres_url, "gf_tick") as database_url:
        ticks = run(args, database_url)
    report = {
        "ticks": ticks,
        "setup": {
            "commit": commit(),
            "jobs": args.jobs,
            "nodes": args.nodes,
            "gpus_per_node": args.gpus,
            "cpus": os.cpu_count(),
            "load_1min": round(os.getloadavg()[0], 2),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
