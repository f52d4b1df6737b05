"""Helpers to run real GreenFlow processes (uvicorn servers, CLI commands) in tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

BIN_DIR = Path(sys.executable).parent
GREENFLOW = str(BIN_DIR / "greenflow")


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_cli(
    args: list[str], env: Mapping[str, str], timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run `greenflow ARGS` and capture its output."""
    return subprocess.run(
        [GREENFLOW, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def wait_http_ok(
    url: str, timeout_s: float = 30, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll `url` until it answers 200, failing early if `process` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


@contextmanager
def running(
    args: list[str], env: Mapping[str, str], log_path: Path, health_url: str | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Start `greenflow ARGS` in the background; stop it (SIGTERM, then SIGKILL) on exit."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [GREENFLOW, *args], env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            if health_url:
                wait_http_ok(health_url, process=process)
            yield process
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
