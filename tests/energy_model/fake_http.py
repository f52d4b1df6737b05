"""A real HTTP server on 127.0.0.1 that answers scripted responses (for provider clients)."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Reply:
    """One scripted answer."""

    status: int = 200
    body: Any = None  # dict/list -> JSON; str -> sent as is
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Seen:
    """One request the server received."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]


Responder = Callable[[Seen], Reply]


class FakeServer:
    """Routes exact paths to a queue of replies (the last one repeats) or a responder."""

    def __init__(self) -> None:
        self.routes: dict[str, list[Reply] | Responder] = {}
        self.requests: list[Seen] = []
        self.hits: dict[str, int] = defaultdict(int)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                return

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                seen = Seen("GET", parts.path, parse_qs(parts.query), dict(self.headers))
                server.requests.append(seen)
                server.hits[parts.path] += 1
                route = server.routes.get(parts.path)
                if route is None:
                    reply = Reply(404, {"error": f"no route {parts.path}"})
                elif callable(route):
                    reply = route(seen)
                else:
                    reply = route.pop(0) if len(route) > 1 else route[0]
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                if isinstance(reply.body, (dict, list)):
                    payload = json.dumps(reply.body).encode()
                elif reply.body is None:
                    payload = b""
                else:
                    payload = str(reply.body).encode()
                try:
                    self.send_response(reply.status)
                    if reply.status != 204:
                        self.send_header("Content-Type", reply.content_type)
                    self.send_header(
                        "Content-Length", str(len(payload) if reply.status != 204 else 0)
                    )
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    if reply.status != 204:
                        self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:<port>."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def wait_for_hits(self, path: str, count: int, timeout_s: float = 10.0) -> int:
        """Hits on `path` once they reach `count` (or after `timeout_s`).

        A client that timed out has sent its request, but the server thread may read it later
        than the client gives up on a loaded machine.
        """
        deadline = time.monotonic() + timeout_s
        while self.hits[path] < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.hits[path]

    def route(self, path: str, *replies: Reply | Responder) -> None:
        """Answer `path` with these replies in order (the last repeats), or a responder."""
        if len(replies) == 1 and callable(replies[0]) and not isinstance(replies[0], Reply):
            self.routes[path] = replies[0]
        else:
            self.routes[path] = [r for r in replies if isinstance(r, Reply)]

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()


def serve() -> Iterator[FakeServer]:
    """Generator for a pytest fixture."""
    server = FakeServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
