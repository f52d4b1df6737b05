"""The live service at cluster scale: `greenflow serve` on PostgreSQL driving many nodes (JSON out).

Per case (jobs x nodes x GPUs per node): a fresh database, `greenflow serve` as shipped (control
loop on; `--slot-s`, default 300 s, and a one-day horizon), and one `bench.load_agent` process that
registers the nodes with their own credentials, acknowledges commands by the real protocol and
reports synthetic telemetry (no training). The jobs are submitted over the API (no deadline,
1-8 GPUs, far more work than the run lasts). Then one more submission wakes a tick with every
job known, `--ticks` times; each such tick's figures come from the loop's metrics
(`greenflow_control_loop_last_tick_duration_seconds` and `..._last_tick_phase_seconds{phase}`).
While that tick runs a reader lists jobs (`GET /v1/jobs?limit=50`, 4 in flight, or
`--reader-concurrency`): `api_p99_ms`. `snapshot_cpu_s`, `models_cpu_s` and `write_cpu_s`
are the tick thread's own CPU in those phases: the rest of their time it waited (the database,
the GIL shared with the API's requests, other processes on the CPU). `refits_s` is the tick's
wait, at its start, for the model refits the tick before it started beside its solve, and
`refits_cpu_s` those refits' CPU in their own thread.
`command_rtt_s` is the median, over the case's acknowledged commands, of acknowledged minus
written (the plan's write to the agent's answer being recorded).

Admission (`--admission-concurrency`): with the last case's jobs queued, rounds of that many
deadline submissions at once (each must be promised: 6 h of slack); p50/p99 of their latency.

Usage:
    python -m bench.service_scale [--cases 100x4x8,1000x32x8] [--ticks 2]
        [--admission-concurrency 1,8] [--admission-rounds 3] [--postgres-url URL]
        [--register-timeout-s 300] [--reader-concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from bench.api_load import (
    DEFAULT_URL,
    REPO_ROOT,
    commit,
    free_port,
    fresh_database,
    greenflow_command,
    greenflow_env,
    wait_ok,
)

LOOP = "greenflow_control_loop"


@contextmanager
def logged_server(args: list[str], env: dict[str, str], port: int, log: Path) -> Iterator[None]:
    """`greenflow serve` with its log in `log` (the tail goes to stderr if the case fails)."""
    with open(log, "wb") as out:
        process = subprocess.Popen(args, env={**os.environ, **env}, stdout=out, stderr=out)
        try:
            wait_ok(f"http://127.0.0.1:{port}/healthz", process)
            yield
        except BaseException:
            sys.stderr.write(log.read_text(errors="replace")[-4000:])
            raise
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def make_tokens(database_url: str, nodes: int) -> tuple[str, str, list[tuple[str, str]]]:
    """Migrate, then create a user, an operator and one agent credential per node."""
    from scheduler_service.auth.service import create_token
    from scheduler_service.auth.tokens import Role
    from scheduler_service.db import migrate
    from scheduler_service.db.session import make_engine, make_session_factory, transaction

    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    with transaction(make_session_factory(engine)) as session:
        user = create_token(session, name="alice", role=Role.USER)
        operator = create_token(session, name="ops", role=Role.OPERATOR)
        agents = [
            (f"node-{i:03d}", create_token(session, name=f"node-{i:03d}", role=Role.AGENT))
            for i in range(nodes)
        ]
    engine.dispose()
    return user, operator, agents


def metrics(base_url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed `name` or `name{label="value"}`."""
    response = httpx.get(f"{base_url}/metrics", timeout=30)
    response.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def job_body(deadline: datetime | None = None, samples: int = 10**12) -> dict[str, Any]:
    """A valid job spec (no deadline unless given) with a fresh submission_id."""
    body: dict[str, Any] = {
        "name": "scale",
        "workload": "resnet50",
        "global_batch_size": 256,
        "total_samples": samples,
        "min_gpus": 1,
        "max_gpus": 8,
        "submission_id": uuid.uuid4().hex,
    }
    if deadline is not None:
        body["deadline"] = deadline.isoformat()
    return body


# Tries per submission whose connection drops: the same body again (its submission_id makes the
# retry idempotent: a job the server stored already is answered 200, not stored twice).
SUBMIT_TRIES = 5


async def submit_many(base_url: str, token: str, count: int, concurrency: int = 16) -> int:
    """Submit `count` jobs, `concurrency` at a time; how many requests lost their connection and
    were sent again (a dropped keep-alive connection ended two whole runs at load 12)."""
    headers = {"Authorization": f"Bearer {token}"}
    queue = iter(range(count))
    dropped = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def worker() -> None:
            nonlocal dropped
            for _ in queue:
                body = job_body()
                for attempt in range(SUBMIT_TRIES):
                    try:
                        response = await client.post("/v1/jobs", json=body, headers=headers)
                        break
                    except httpx.TransportError:
                        dropped += 1
                        if attempt == SUBMIT_TRIES - 1:
                            raise
                response.raise_for_status()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return dropped


async def read_while(
    base_url: str, token: str, done: asyncio.Event, in_flight: int = 4
) -> tuple[list[float], int]:
    """Latencies (s) of `GET /v1/jobs?limit=50`, `in_flight` at once, until `done` is set; and
    how many requests lost their connection (asked again: one such drop under load ended a whole
    run)."""
    headers = {"Authorization": f"Bearer {token}"}
    latencies: list[float] = []
    dropped = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def worker() -> None:
            nonlocal dropped
            while not done.is_set():
                began = time.perf_counter()
                try:
                    response = await client.get("/v1/jobs", params={"limit": 50}, headers=headers)
                except httpx.TransportError:
                    dropped += 1
                    continue
                response.raise_for_status()
                latencies.append(time.perf_counter() - began)

        await asyncio.gather(*(worker() for _ in range(in_flight)))
    return latencies, dropped


async def woken_tick(
    base_url: str, token: str, jobs: int, timeout_s: float, readers: int = 4
) -> dict[str, Any]:
    """Wake a tick with one more submission; its figures and the API latency while it ran
    (`readers` requests in flight; 0: none, the tick shares the server with the agents only)."""
    before = metrics(base_url)
    ticks = before.get(f"{LOOP}_ticks_total", 0.0)
    done = asyncio.Event()
    reader = asyncio.create_task(read_while(base_url, token, done, readers))
    await submit_many(base_url, token, 1, 1)
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            now = metrics(base_url)
        except httpx.TransportError:
            # A big tick can hold the GIL for longer than one scrape waits, or a kept-alive
            # connection drop: ask again (within the deadline).
            now = {}
        # A tick that began before the last submissions were stored plans fewer jobs: wait for
        # one that planned them all.
        if (
            now.get(f"{LOOP}_ticks_total", 0.0) > ticks
            and now.get(f"{LOOP}_last_tick_jobs_planned", 0.0) >= jobs
        ):
            break
        if time.monotonic() > deadline_s:
            done.set()
            await reader
            raise TimeoutError(f"no tick within {timeout_s} s")
        await asyncio.sleep(0.2)
    done.set()
    latencies, dropped = await reader
    phase = {
        name: now.get(f'{LOOP}_last_tick_phase_seconds{{phase="{name}"}}')
        for name in ("refits", "snapshot", "models", "solve", "write", "dispatch")
    }
    # The tick thread's own CPU in the phases it runs in Python: the rest of their wall time
    # it waited (the database, the GIL shared with the API's requests, other processes).
    cpu = {
        name: now.get(f'{LOOP}_last_tick_phase_cpu_seconds{{phase="{name}"}}')
        for name in ("snapshot", "models", "write")
    }
    # The refit thread's CPU for the refits the tick waited for (they ran beside the last solve).
    cpu["refits"] = now.get(f'{LOOP}_last_tick_phase_cpu_seconds{{phase="refits"}}')
    return {
        "tick_s": now[f"{LOOP}_last_tick_duration_seconds"],
        "jobs_planned": int(now[f"{LOOP}_last_tick_jobs_planned"]),
        **{f"{name}_s": value for name, value in phase.items()},
        **{f"{name}_cpu_s": value for name, value in cpu.items()},
        "solve_cpu_s": now.get(f"{LOOP}_last_solve_cpu_seconds"),
        "api_p99_ms": percentile_ms(latencies, 99),
        "api_requests": len(latencies),
        "api_dropped": dropped,
    }


def percentile_ms(values_s: list[float], q: int) -> float | None:
    """The q-th percentile in ms (None with fewer than two values)."""
    if len(values_s) < 2:
        return None
    return round(1000 * statistics.quantiles(values_s, n=100, method="inclusive")[q - 1], 1)


def command_rtt_s(database_url: str) -> float | None:
    """Median of acknowledged minus written over acknowledged commands."""
    engine = create_engine(database_url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT EXTRACT(EPOCH FROM (acked_at - created_at)) FROM allocations "
                "WHERE acked_at IS NOT NULL"
            )
        ).scalars()
        values = [float(v) for v in rows]
    engine.dispose()
    return round(statistics.median(values), 3) if values else None


def wait_nodes(base_url: str, operator: str, nodes: int, timeout_s: float = 300) -> None:
    """Until every node is registered and ready."""
    deadline_s = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {operator}"}
    while time.monotonic() < deadline_s:
        listed = httpx.get(f"{base_url}/v1/nodes", headers=headers, timeout=30).json()
        if sum(1 for n in listed if n.get("state") == "ready") >= nodes:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{nodes} nodes did not register within {timeout_s} s")


async def admission_round(base_url: str, token: str, concurrency: int) -> list[float]:
    """`concurrency` deadline submissions at once; their latencies (s)."""
    headers = {"Authorization": f"Bearer {token}"}
    deadline = datetime.now(UTC) + timedelta(hours=6)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one() -> float:
            began = time.perf_counter()
            response = await client.post(
                "/v1/jobs", json=job_body(deadline, samples=2_560_000), headers=headers
            )
            if response.status_code != 201:
                raise RuntimeError(f"admission answered {response.status_code}: {response.text}")
            return time.perf_counter() - began

        return list(await asyncio.gather(*(one() for _ in range(concurrency))))


def run_case(args: argparse.Namespace, jobs: int, nodes: int, gpus: int) -> dict[str, Any]:
    """One case; with admission figures when `args.admission_concurrency` is set."""
    with fresh_database(args.postgres_url, "gf_scale") as database_url:
        user, operator, agents = make_tokens(database_url, nodes)
        with tempfile.TemporaryDirectory() as workdir:
            config = Path(workdir) / "greenflow.toml"
            config.write_text(
                f"[planner]\nslot_s = {args.slot_s}\nhorizon_s = {args.horizon_s}\n"
                "[cluster]\nheartbeat_timeout_s = 60\n"
            )
            tokens = Path(workdir) / "tokens"
            tokens.write_text("".join(f"{name} {token}\n" for name, token in agents))
            port, agent_port = free_port(), free_port()
            base_url = f"http://127.0.0.1:{port}"
            env = {**greenflow_env(database_url, port), "GREENFLOW_CONFIG": str(config)}
            agent_cmd = [
                sys.executable, "-m", "bench.load_agent", "--scheduler", base_url,
                "--tokens", str(tokens), "--gpus-per-node", str(gpus), "--port", str(agent_port),
            ]  # fmt: skip
            log_path = Path(args.log_dir or workdir) / f"serve-{jobs}x{nodes}.log"
            with logged_server(greenflow_command(port), env, port, log_path):
                agent = subprocess.Popen(
                    agent_cmd,
                    env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                try:
                    wait_nodes(base_url, operator, nodes, args.register_timeout_s)
                    began = time.perf_counter()
                    submit_dropped = asyncio.run(submit_many(base_url, user, jobs))
                    submit_s = time.perf_counter() - began
                    ticks = [
                        asyncio.run(
                            woken_tick(
                                base_url, user, jobs, args.tick_timeout_s, args.reader_concurrency
                            )
                        )
                        for _ in range(args.ticks)
                    ]
                    admission = []
                    if args.admission_concurrency:
                        for concurrency in args.admission_concurrency:
                            latencies: list[float] = []
                            for _ in range(args.admission_rounds):
                                latencies += asyncio.run(
                                    admission_round(base_url, user, concurrency)
                                )
                            admission.append(
                                {
                                    "queued": jobs,
                                    "concurrency": concurrency,
                                    "p50_s": round(statistics.median(latencies), 3),
                                    "p99_s": round(
                                        statistics.quantiles(latencies, n=100, method="inclusive")[
                                            98
                                        ],
                                        3,
                                    )
                                    if len(latencies) > 1
                                    else round(latencies[0], 3),
                                }
                            )
                finally:
                    agent.terminate()
                    try:
                        agent.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        agent.kill()
            rtt = command_rtt_s(database_url)
    last = ticks[-1]
    return {
        "case": {
            "jobs": jobs,
            "nodes": nodes,
            "gpus": nodes * gpus,
            "tick_s": round(last["tick_s"], 3),
            **{
                key: None if last[key] is None else round(last[key], 3)
                for key in (
                    "refits_s",
                    "refits_cpu_s",
                    "snapshot_s",
                    "snapshot_cpu_s",
                    "models_s",
                    "models_cpu_s",
                    "solve_s",
                    "solve_cpu_s",
                    "write_s",
                    "write_cpu_s",
                    "dispatch_s",
                )
            },
            "command_rtt_s": rtt,
            "api_p99_ms": last["api_p99_ms"],
            "jobs_planned": last["jobs_planned"],
            "submit_s": round(submit_s, 2),
            "submit_dropped": submit_dropped,
            "ticks": ticks,
        },
        "admission": admission,
    }


def main() -> None:
    """Run the cases and print the JSON figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=DEFAULT_URL)
    parser.add_argument("--cases", default="100x4x8,1000x32x8")
    parser.add_argument("--ticks", type=int, default=2)
    parser.add_argument("--slot-s", type=int, default=300)
    parser.add_argument("--horizon-s", type=int, default=86_400)
    parser.add_argument("--tick-timeout-s", type=float, default=600)
    # 256 nodes did not all register within 300 s at load 22-24 on 2 cores.
    parser.add_argument("--register-timeout-s", type=float, default=300)
    parser.add_argument("--admission-concurrency", default="1,8")
    parser.add_argument("--admission-rounds", type=int, default=3)
    # Requests in flight listing jobs while a measured tick runs (its API p99); 0: none.
    parser.add_argument("--reader-concurrency", type=int, default=4)
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    args = parser.parse_args()
    args.admission_concurrency = [int(c) for c in args.admission_concurrency.split(",") if c]
    # The code the servers run is the checkout's at the start (a run lasts long enough for
    # commits to land meanwhile).
    started_at_commit = commit()
    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    rows = []
    admission: list[dict[str, Any]] = []
    for index, (jobs, nodes, gpus) in enumerate(cases):
        # Admission is measured once, with the largest queue (the last case).
        last = index == len(cases) - 1
        result = run_case(
            argparse.Namespace(
                **{
                    **vars(args),
                    "admission_concurrency": args.admission_concurrency if last else [],
                }
            ),
            jobs,
            nodes,
            gpus,
        )
        rows.append(result["case"])
        sys.stderr.write(json.dumps(result) + "\n")
        admission += result["admission"]
    report = {
        "cases": rows,
        "admission": admission,
        "setup": {
            "commit": started_at_commit,
            "slot_s": args.slot_s,
            "horizon_s": args.horizon_s,
            "cpus": os.cpu_count(),
            "load_1min": round(os.getloadavg()[0], 2),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
