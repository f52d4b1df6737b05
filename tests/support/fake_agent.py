"""An HTTP server that answers the scheduler's allocation and stop calls as an agent would,
and records when each arrived and was answered (for tests of the control loop's delivery)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from worker_agent.protocol import AllocationAck, AllocationCommand


@dataclass(frozen=True)
class Call:
    """One command an agent received: what, and when (monotonic seconds) it came and was answered."""

    node: str
    job_id: int
    generation: int
    gpus: int  # 0: a pause; -1: a stop
    received_s: float
    answered_s: float


@dataclass
class FakeAgent:
    """Answers every allocation with an acknowledgement at the step `steps` says (default 0),
    a pause only after `pause_delay_s` (an agent checkpoints the job before it answers); a new
    count of a job in `running` as a hot switch, of any other as a start from a checkpoint."""

    name: str
    pause_delay_s: float = 0.0
    steps: dict[int, int] = field(default_factory=dict)
    running: set[int] = field(default_factory=set)
    calls: list[Call] = field(default_factory=list)
    commands: list[AllocationCommand] = field(default_factory=list)
    url: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, path: str, body: bytes) -> tuple[int, bytes]:
        """The status and body an agent would answer to a POST of `body` to `path`."""
        received_s = time.monotonic()
        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "jobs" or parts[2] not in ("allocation", "stop"):
            return 404, b'{"detail": "not found"}'
        if parts[2] == "stop":
            data = json.loads(body)
            self._note(Call(self.name, data["job_id"], data["generation"], -1, received_s,
                            time.monotonic()))  # fmt: skip
            return 200, b"{}"
        command = AllocationCommand.model_validate_json(body)
        gpus = len(command.slot_indices) + sum(len(p.slot_indices) for p in command.remote)
        if gpus == 0:
            time.sleep(self.pause_delay_s)
        step = self.steps.get(command.job_id, 0)
        switch = gpus > 0 and command.job_id in self.running
        ack = AllocationAck(
            job_id=command.job_id,
            generation=command.generation,
            gpus=gpus,
            layout=f"dp{gpus}-tp1-pp1" if gpus else None,
            step=step,
            worker_pids=list(range(1000, 1000 + gpus)),
            hot_switch=switch,
            resumed_from=f"checkpoint@step{step}" if gpus and not switch else None,
        )
        self.commands.append(command)
        self._note(Call(self.name, command.job_id, command.generation, gpus, received_s,
                        time.monotonic()))  # fmt: skip
        return 200, ack.model_dump_json().encode()

    def _note(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)


@contextmanager
def serving(agent: FakeAgent) -> Iterator[FakeAgent]:
    """Serve `agent` on a free port of 127.0.0.1 (its `url` set) until the block ends."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            status, out = agent.answer(self.path, body)
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, format: str, *args: object) -> None:
            pass  # the test's output, not one line per call

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    agent.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name=f"fake-agent-{agent.name}")
    thread.start()
    try:
        yield agent
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
