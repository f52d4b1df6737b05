"""Submission load: `greenflow serve` against a bare endpoint on the same PostgreSQL (JSON out).

The bare reference is the least a submission can cost here: FastAPI, one uvicorn worker, a
psycopg connection pool and one `INSERT ... RETURNING id` into a table with a unique
(owner, submission_id) key. `greenflow serve` runs as shipped (control loop on, default config)
on its own fresh database. Both get the same body (a valid job spec with a fresh submission_id
and no deadline) and the same bearer header from the same load generator (httpx, async,
`concurrency` requests in flight), one after the other, alternating which goes first each round.
Figures per concurrency, over all rounds: requests/s completed in the measured windows and the
99th percentile latency; `ratio` = greenflow_rps / bare_rps; `*_cpu_ms` the server process's CPU
time (user + system, from /proc) per completed request over each whole run (warm-up included),
the figure other work on a shared machine disturbs least.

With `--no-loop` the scheduler runs as an API-only replica (no control loop, so no tick woken
by each submission): the API's own cost. With `--startup`: seconds from spawning `greenflow serve` to its first 200 on /healthz, and the
wall time of a client command (`greenflow jobs --limit 1` against the running server), medians.

Usage:
    python -m bench.api_load [--postgres-url URL] [--concurrency 1,16] [--seconds 5]
        [--rounds 3] [--warmup-s 1] [--startup]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

DEFAULT_URL = os.environ.get(
    "GREENFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REPO_ROOT = Path(__file__).resolve().parent.parent
BARE_TABLE = """
CREATE TABLE bare_jobs (
    id BIGSERIAL PRIMARY KEY,
    owner TEXT NOT NULL,
    submission_id TEXT NOT NULL,
    body JSONB NOT NULL,
    UNIQUE (owner, submission_id)
)
"""


def bare_app(dsn: str) -> Any:
    """The reference endpoint: POST /v1/jobs stores the body with one INSERT ... RETURNING id."""
    from fastapi import FastAPI
    from psycopg.types.json import Jsonb
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(dsn, min_size=4, max_size=16, open=False)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        pool.open(wait=True)
        yield
        pool.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/jobs", status_code=201)
    def submit(body: dict[str, Any]) -> dict[str, int]:
        with pool.connection() as conn:
            row = conn.execute(
                "INSERT INTO bare_jobs (owner, submission_id, body) VALUES (%s, %s, %s)"
                " RETURNING id",
                ("alice", str(body.get("submission_id")), Jsonb(body)),
            ).fetchone()
        assert row is not None
        return {"id": int(row[0])}

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def fresh_database(admin_url: str, prefix: str) -> Iterator[str]:
    """An empty database on the server of `admin_url`, dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def wait_ok(url: str, process: subprocess.Popen[bytes], timeout_s: float = 180.0) -> float:
    """Seconds until GET `url` answers 200 (raises if the process exits or time runs out)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s} s")


@dataclass(frozen=True)
class Started:
    """A server that answers: its process id and the seconds it took to answer /healthz."""

    pid: int
    took_s: float


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        # The fields after the parenthesised command name; utime and stime are the 12th and 13th.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def server(args: list[str], env: dict[str, str], port: int) -> Iterator[Started]:
    """A server process on `port`, once it answers /healthz."""
    with tempfile.TemporaryDirectory() as workdir:
        process = subprocess.Popen(
            args,
            env={**os.environ, **env},
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            yield Started(process.pid, wait_ok(f"http://127.0.0.1:{port}/healthz", process))
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def greenflow_env(database_url: str, port: int, *, loop: bool = True) -> dict[str, str]:
    """Environment of a `greenflow serve` on this database and port (control loop on or off)."""
    return {
        "GREENFLOW_DATABASE_URL": database_url,
        "GREENFLOW_PORT": str(port),
        "GREENFLOW_SECRET_KEY": "bench-" + "k" * 42,
        "GREENFLOW_RUN_CONTROL_LOOP": "true" if loop else "false",
        "PYTHONPATH": str(REPO_ROOT),
    }


def greenflow_command(port: int) -> list[str]:
    """`greenflow serve` from this checkout."""
    return [sys.executable, "-m", "scheduler_service.cli", "serve", "--port", str(port)]


@dataclass
class Run:
    """Requests completed in the measured window of one run, their latencies and failures."""

    window_s: float
    completed: int = 0
    failed: int = 0
    latencies_s: list[float] = field(default_factory=list)
    # Over the whole run, warm-up included: requests answered 201 and the server's CPU seconds.
    all_completed: int = 0
    server_cpu_s: float = 0.0


def job_body() -> dict[str, Any]:
    """A valid job spec without a deadline, with a fresh submission_id."""
    return {
        "name": "bench",
        "workload": "gpt2",
        "global_batch_size": 64,
        "total_samples": 64_000,
        "min_gpus": 1,
        "max_gpus": 8,
        "submission_id": uuid.uuid4().hex,
    }


async def submit_load(
    base_url: str, token: str, concurrency: int, seconds: float, warmup_s: float
) -> Run:
    """Keep `concurrency` submissions in flight for warmup_s + seconds; measure the last part."""
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    run = Run(window_s=seconds)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60) as client:
        begin = time.perf_counter()
        measure_from = begin + warmup_s
        end = measure_from + seconds

        async def worker() -> None:
            while (started := time.perf_counter()) < end:
                response = await client.post("/v1/jobs", json=job_body(), headers=headers)
                done = time.perf_counter()
                run.all_completed += response.status_code == 201
                if started >= measure_from and done <= end:
                    run.latencies_s.append(done - started)
                    if response.status_code == 201:
                        run.completed += 1
                    else:
                        run.failed += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return run


def p99_ms(latencies_s: list[float]) -> float | None:
    """The 99th percentile in milliseconds (None without samples)."""
    if len(latencies_s) < 2:
        return None
    return round(1000 * statistics.quantiles(latencies_s, n=100, method="inclusive")[98], 2)


def summarise(concurrency: int, runs: dict[str, list[Run]]) -> dict[str, Any]:
    """One row of the `submit` table from every round's runs."""
    rps = {
        name: sum(r.completed for r in rs) / sum(r.window_s for r in rs)
        for name, rs in runs.items()
    }
    latencies = {name: [x for r in rs for x in r.latencies_s] for name, rs in runs.items()}
    cpu_ms = {
        name: round(
            1000 * sum(r.server_cpu_s for r in rs) / max(1, sum(r.all_completed for r in rs)), 3
        )
        for name, rs in runs.items()
    }
    return {
        "concurrency": concurrency,
        "greenflow_rps": round(rps["greenflow"], 1),
        "bare_rps": round(rps["bare"], 1),
        "ratio": round(rps["greenflow"] / rps["bare"], 3) if rps["bare"] else None,
        "greenflow_p99_ms": p99_ms(latencies["greenflow"]),
        "bare_p99_ms": p99_ms(latencies["bare"]),
        "greenflow_cpu_ms": cpu_ms["greenflow"],
        "bare_cpu_ms": cpu_ms["bare"],
        "greenflow_failed": sum(r.failed for r in runs["greenflow"]),
        "bare_failed": sum(r.failed for r in runs["bare"]),
    }


def create_user_token(database_url: str) -> str:
    """Migrate greenflow's database and create a user token in it."""
    from scheduler_service.auth.service import create_token
    from scheduler_service.auth.tokens import Role
    from scheduler_service.db import migrate
    from scheduler_service.db.session import make_engine, make_session_factory, transaction

    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    with transaction(make_session_factory(engine)) as session:
        token = create_token(session, name="alice", role=Role.USER)
    engine.dispose()
    return token


def startup_figures(database_url: str, base_url: str, token: str, repeat: int) -> dict[str, Any]:
    """Median seconds to /healthz of a new `greenflow serve`, and of one client command."""
    healthz = []
    for _ in range(repeat):
        port = free_port()
        with server(greenflow_command(port), greenflow_env(database_url, port), port) as started:
            healthz.append(started.took_s)
    client = []
    env = {**os.environ, "GREENFLOW_URL": base_url, "GREENFLOW_TOKEN": token}
    env["PYTHONPATH"] = str(REPO_ROOT)
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "scheduler_service.cli", "jobs", "--limit", "1"],
            env=env,
            check=True,
            capture_output=True,
        )
        client.append(time.perf_counter() - start)
    return {
        "serve_healthz_s": round(statistics.median(healthz), 2),
        "serve_healthz_s_all": [round(x, 2) for x in healthz],
        "cli_jobs_s": round(statistics.median(client), 2),
        "cli_jobs_s_all": [round(x, 2) for x in client],
    }


def commit() -> str:
    """The checkout's commit (with `+dirty` when it has uncommitted changes)."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return head + ("+dirty" if dirty else "")


def main() -> None:
    """Run both servers under the same load, alternating, and print the JSON figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=DEFAULT_URL)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--no-loop",
        action="store_true",
        help="Serve without the control loop (an API-only replica): the API's own cost.",
    )
    parser.add_argument("--startup", action="store_true")
    parser.add_argument("--startup-repeat", type=int, default=3)
    # Internal: the bare server's own process.
    parser.add_argument("--serve-bare", metavar="DSN", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        import uvicorn

        uvicorn.run(bare_app(args.serve_bare), host="127.0.0.1", port=args.port, workers=1)
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    with (
        fresh_database(args.postgres_url, "gf_bench") as greenflow_url,
        fresh_database(args.postgres_url, "bare_bench") as bare_url,
    ):
        token = create_user_token(greenflow_url)
        engine = create_engine(bare_url)
        with engine.begin() as conn:
            conn.execute(text(BARE_TABLE))
        engine.dispose()
        bare_dsn = make_url(bare_url).set(drivername="postgresql").render_as_string(False)
        gf_port, bare_port = free_port(), free_port()
        bare_cmd = [sys.executable, "-m", "bench.api_load", "--serve-bare", bare_dsn]
        with (
            server(
                greenflow_command(gf_port),
                greenflow_env(greenflow_url, gf_port, loop=not args.no_loop),
                gf_port,
            ) as greenflow_server,
            server(
                [*bare_cmd, "--port", str(bare_port)], {"PYTHONPATH": str(REPO_ROOT)}, bare_port
            ) as bare_server,
        ):
            pids = {"greenflow": greenflow_server.pid, "bare": bare_server.pid}
            urls = {
                "greenflow": f"http://127.0.0.1:{gf_port}",
                "bare": f"http://127.0.0.1:{bare_port}",
            }
            rows = []
            for concurrency in levels:
                runs: dict[str, list[Run]] = {"greenflow": [], "bare": []}
                for round_index in range(args.rounds):
                    order = ["greenflow", "bare"] if round_index % 2 == 0 else ["bare", "greenflow"]
                    for name in order:
                        cpu_before = cpu_s(pids[name])
                        run = asyncio.run(
                            submit_load(urls[name], token, concurrency, args.seconds, args.warmup_s)
                        )
                        run.server_cpu_s = cpu_s(pids[name]) - cpu_before
                        runs[name].append(run)
                rows.append(summarise(concurrency, runs))
            report: dict[str, Any] = {
                "submit": rows,
                "setup": {
                    "commit": commit(),
                    "seconds": args.seconds,
                    "warmup_s": args.warmup_s,
                    "rounds": args.rounds,
                    "control_loop": not args.no_loop,
                    "cpus": os.cpu_count(),
                    "load_1min": round(os.getloadavg()[0], 2),
                },
            }
            if args.startup:
                report["startup"] = startup_figures(
                    greenflow_url, urls["greenflow"], token, args.startup_repeat
                )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
