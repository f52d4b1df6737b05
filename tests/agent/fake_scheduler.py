"""A real HTTP server on 127.0.0.1 that implements the scheduler's three agent endpoints.

It validates every body with the protocol models, records what it received, and can be told to
fail (503 on telemetry, 404 on a heartbeat) to exercise the agent's retries.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import BaseModel, ValidationError

from worker_agent.protocol import (
    Heartbeat,
    HeartbeatAck,
    NodePowerSample,
    NodeRegistered,
    NodeRegistration,
    TelemetryAck,
    TelemetryReport,
    TelemetrySample,
)


@dataclass
class FakeScheduler:
    """What the fake received, and how it should answer next."""

    token: str = "agent-token"
    heartbeat_interval_s: float = 0.5
    telemetry_interval_s: float = 0.5
    registrations: list[NodeRegistration] = field(default_factory=list)
    secrets_issued: list[str] = field(default_factory=list)
    """The agent secret handed out at each registration (the newest is in force)."""
    heartbeats: list[Heartbeat] = field(default_factory=list)
    samples: dict[str, TelemetrySample] = field(default_factory=dict)
    node_power: dict[str, NodePowerSample] = field(default_factory=dict)
    """Node power samples received, by sample_id."""
    idle_power_per_gpu_w: float = 60.0
    host_power_w: float = 150.0
    telemetry_posts: int = 0
    duplicates: int = 0
    unauthorized: int = 0
    fail_telemetry: int = 0
    """Answer this many telemetry posts with 503 (then succeed)."""
    forget_node: bool = False
    """Answer the next heartbeat with 404 (unknown node)."""
    stop_job_ids: list[int] = field(default_factory=list)
    bundles: dict[str, bytes] = field(default_factory=dict)
    """Workdir bundles by SHA-256, served at GET /v1/bundles/{sha256}."""
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    restart: _Serving | None = None

    def current_secret(self) -> str:
        """The secret the agent accepts now (handed out at its newest registration)."""
        with self.lock:
            return self.secrets_issued[-1]

    def job_samples(self, job_id: int) -> list[TelemetrySample]:
        """Samples of one job in time order."""
        with self.lock:
            return sorted(
                (s for s in self.samples.values() if s.job_id == job_id), key=lambda s: s.at
            )

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 60) -> None:
        """Poll until predicate() holds; fail the test if it never does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(f"condition not met within {timeout_s} s")


def _handler(fake: FakeScheduler) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return

        def _send(self, status: int, body: BaseModel | dict[str, Any]) -> None:
            data = (
                body.model_dump_json().encode()
                if isinstance(body, BaseModel)
                else json.dumps(body).encode()
            )
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.headers.get("authorization") != f"Bearer {fake.token}":
                self._send(401, {"detail": "bad token"})
                return
            sha = self.path.removeprefix("/v1/bundles/")
            with fake.lock:
                data = fake.bundles.get(sha) if self.path.startswith("/v1/bundles/") else None
            if data is None:
                self._send(404, {"detail": f"no route or bundle {self.path}"})
                return
            self.send_response(200)
            self.send_header("content-type", "application/gzip")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("authorization") != f"Bearer {fake.token}":
                with fake.lock:
                    fake.unauthorized += 1
                self._send(401, {"detail": "bad token"})
                return
            try:
                self._route(raw)
            except ValidationError as exc:
                self._send(422, {"detail": exc.errors(include_url=False)})

        def _route(self, raw: bytes) -> None:
            path = self.path
            if path == "/v1/nodes/register":
                reg = NodeRegistration.model_validate_json(raw)
                with fake.lock:
                    fake.registrations.append(reg)
                    node_id = len(fake.registrations)
                    secret = secrets.token_hex(32)
                    fake.secrets_issued.append(secret)
                self._send(
                    200,
                    NodeRegistered(
                        node_id=node_id,
                        heartbeat_interval_s=fake.heartbeat_interval_s,
                        telemetry_interval_s=fake.telemetry_interval_s,
                        agent_secret=secret,
                        idle_power_per_gpu_w=fake.idle_power_per_gpu_w,
                        host_power_w=fake.host_power_w,
                    ),
                )
            elif path.startswith("/v1/nodes/") and path.endswith("/heartbeat"):
                hb = Heartbeat.model_validate_json(raw)
                with fake.lock:
                    if fake.forget_node:
                        fake.forget_node = False
                        self._send(404, {"detail": "unknown node"})
                        return
                    fake.heartbeats.append(hb)
                    stop = list(fake.stop_job_ids)
                self._send(200, HeartbeatAck(stop_job_ids=stop))
            elif path == "/v1/telemetry":
                report = TelemetryReport.model_validate_json(raw)
                with fake.lock:
                    fake.telemetry_posts += 1
                    if fake.fail_telemetry > 0:
                        fake.fail_telemetry -= 1
                        self._send(503, {"detail": "restarting"})
                        return
                    stored = dups = 0
                    for s in report.samples:
                        if s.sample_id in fake.samples:
                            dups += 1
                        else:
                            fake.samples[s.sample_id] = s
                            stored += 1
                    fake.duplicates += dups
                    for power in report.node_power:
                        fake.node_power.setdefault(power.sample_id, power)
                self._send(200, TelemetryAck(stored=stored, duplicates=dups))
            else:
                self._send(404, {"detail": f"no route {path}"})

    return Handler


class _Serving:
    """The fake's HTTP server; it can go down and come back on the same port (a restart)."""

    def __init__(self, fake: FakeScheduler) -> None:
        self.fake = fake
        self.port = 0
        self.server: ThreadingHTTPServer | None = None
        self.up()
        fake.url = f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self.fake))
        server.daemon_threads = True
        self.port = int(server.server_address[1])
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.server = server

    def down(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@contextmanager
def fake_scheduler(**kwargs: Any) -> Iterator[FakeScheduler]:
    """Serve a FakeScheduler on a free port for the duration of the block."""
    fake = FakeScheduler(**kwargs)
    serving = _Serving(fake)
    fake.restart = serving
    try:
        yield fake
    finally:
        serving.down()


@contextmanager
def outage(fake: FakeScheduler) -> Iterator[None]:
    """The scheduler is down (connections refused) inside the block, back on the same port after."""
    assert fake.restart is not None
    fake.restart.down()
    try:
        yield
    finally:
        fake.restart.up()
