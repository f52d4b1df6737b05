"""Workers on other nodes: a worker host per node spawns them, and they dial back to the runner.

A job's runner lives on one node. Its workers on another node are started by that node's
`WorkerHost` (a small authenticated TCP service) and connect back to the runner's listener;
from then on the runner drives them exactly like local workers, over a socket instead of a
pipe. Messages to and from them are pickled by value (`PlainChannel`): shared-memory handles
and file descriptors mean nothing on another node.

Authentication is per job: a connection opens with a small JSON hello naming the job and the
runner's node (to a host) or the worker (to a runner), then both sides prove they hold the
job's grant (`protocol.worker_grant` of the host node's secret) with multiprocessing's HMAC
challenge, before anything is unpickled. A host only reaps and kills workers of the job the
grant names. No key is shared across the cluster, and none crosses the network.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import multiprocessing as mp
import os
import pickle
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import (
    Connection,
    answer_challenge,
    deliver_challenge,
)
from multiprocessing.process import BaseProcess
from typing import Any

from worker_agent.protocol import worker_grant
from worker_agent.runtime.errors import WorkerFailed
from worker_agent.runtime.worker import Channel, WorkerConfig, worker_main

HOST_KEY_ENV = "GREENFLOW_WORKER_HOST_KEY"
"""Environment variable carrying a stand-alone worker host's node secret (never in argv)."""

MAX_HELLO_BYTES = 512
"""A hello is a few fields of JSON; anything longer is refused before authentication."""

_SIOCGIFADDR = 0x8915

__all__ = ["Channel", "Dialler", "HostClient", "PlainChannel", "RemoteProcess", "WorkerHost"]


class PlainChannel:
    """A connection that pickles by value, so tensors cross nodes as bytes, not as handles."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def send(self, obj: Any) -> None:
        """Pickle `obj` with plain pickle (tensors by value) and send it."""
        self._conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        """Receive and unpickle one message (only ever from an authenticated peer)."""
        return pickle.loads(self._conn.recv_bytes())

    def poll(self, timeout: float | None = 0.0) -> bool:
        """True when a message (or EOF) is waiting."""
        return self._conn.poll(timeout)

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address` (None if none does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            packed = struct.pack("256s", name.encode()[:15])
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, packed)
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _dial(
    address: tuple[str, int], authkey: bytes, timeout_s: float, hello: dict[str, Any]
) -> Connection:
    """An authenticated connection to `address` that opened with `hello` (which tells the peer
    which key to expect), or OSError within about `timeout_s`."""
    sock = socket.create_connection(address, timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A peer behind a cut link never closes: keepalive probes end the connection (and a remote
    # worker blocked reading from its runner exits) about a minute after the link goes silent.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    # Connection reads the raw descriptor, which must block; reads are bounded by poll().
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        conn.send_bytes(json.dumps(hello).encode())
        if not conn.poll(timeout_s):
            raise OSError(f"worker host {address} did not answer in {timeout_s} s")
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def _read_hello(conn: Connection, timeout_s: float) -> dict[str, Any]:
    """The peer's opening JSON object (bounded in size and time); ValueError if there is none."""
    if not conn.poll(timeout_s):
        raise ValueError("no hello")
    hello = json.loads(conn.recv_bytes(MAX_HELLO_BYTES))
    if not isinstance(hello, dict):
        raise ValueError("the hello is not an object")
    return hello


def remote_worker_main(address: tuple[str, int], authkey: bytes, cfg: WorkerConfig) -> None:
    """Entry point of a worker that a worker host started: dial the runner, then serve it."""
    conn = PlainChannel(_dial(address, authkey, cfg.timeout_s, {"worker_id": cfg.worker_id}))
    worker_main(conn, cfg)


# ----- the host side (one per node) ----------------------------------------------------------
class WorkerHost:
    """Spawns and reaps this node's workers of jobs whose runner lives on another node."""

    def __init__(self, bind_host: str, secret: bytes, port: int = 0) -> None:
        self.secret = secret
        """This node's secret; the agent replaces it at each registration (voiding old grants)."""
        self.bind_host = bind_host
        self.ifname = interface_of(bind_host)
        """The interface whose address peers reach; gloo/NCCL bind their sockets to it."""
        self._sock = socket.create_server((bind_host, port))
        self.port: int = self._sock.getsockname()[1]
        self._ctx = mp.get_context("spawn")
        self._procs: dict[int, BaseProcess] = {}
        self._tags: dict[int, tuple[int | None, str]] = {}
        """(slot index, job id as text) of each worker started, by pid; the job is the one
        the request's grant was for, never what the request says."""
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.admit: Callable[[int | None, str | None], None] | None = None
        """Called before a worker starts for (slot, job tag); raising refuses it (the agent:
        the slot is held by another job)."""

    def serve_forever(self) -> None:
        """Answer requests until close() (one short request per connection)."""
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                break
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock.detach())
        try:
            hello = _read_hello(conn, 10.0)
            job_id, runner_node = int(hello["job_id"]), str(hello["runner"])
            key = worker_grant(self.secret.decode(), job_id, runner_node).encode()
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
            chan = PlainChannel(conn)
            cmd, kwargs = chan.recv()
            if cmd not in ("spawn", "alive", "kill"):
                chan.send(("error", f"unknown request {cmd!r}"))
                return
            try:
                chan.send(("ok", getattr(self, f"_cmd_{cmd}")(str(job_id), key, **kwargs)))
            except Exception as exc:
                chan.send(("error", f"{type(exc).__name__}: {exc}"))
        except (OSError, EOFError, ValueError, KeyError, TypeError, mp.AuthenticationError):
            pass
        finally:
            conn.close()

    def _cmd_spawn(
        self,
        job: str,
        key: bytes,
        cfg: WorkerConfig,
        runner: tuple[str, int],
        slot: int | None = None,
    ) -> int:
        if self.admit is not None:
            self.admit(slot, job)
        cfg = replace(cfg, socket_ifname=self.ifname)
        proc = self._ctx.Process(target=remote_worker_main, args=(runner, key, cfg), daemon=True)
        proc.start()
        assert proc.pid is not None
        with self._lock:
            self._procs[proc.pid] = proc
            self._tags[proc.pid] = (slot, job)
        return proc.pid

    def holdings(self) -> dict[int, str | None]:
        """Slot index -> job tag of every live worker this host started (exited ones reaped)."""
        out: dict[int, str | None] = {}
        with self._lock:
            for pid, proc in list(self._procs.items()):
                if not proc.is_alive():
                    proc.join()
                    self._forget(pid)
                    continue
                slot, job = self._tags.get(pid, (None, ""))
                if slot is not None:
                    out[slot] = job
        return out

    def _own(self, job: str, pid: int) -> BaseProcess | None:
        """The worker `pid` if this host started it for `job` (caller holds the lock)."""
        if pid in self._tags and self._tags[pid][1] != job:
            raise PermissionError(f"pid {pid} is not a worker of job {job}")
        return self._procs.get(pid)

    def _forget(self, pid: int) -> BaseProcess | None:
        """Drop `pid` from the books (caller holds the lock)."""
        self._tags.pop(pid, None)
        return self._procs.pop(pid, None)

    def _cmd_alive(self, job: str, key: bytes, pid: int) -> bool:
        with self._lock:
            proc = self._own(job, pid)
            if proc is not None and not proc.is_alive():
                proc.join()  # exited (released or died): reap it and forget it
                self._forget(pid)
                proc = None
        return proc is not None

    def _cmd_kill(self, job: str, key: bytes, pid: int) -> None:
        with self._lock:
            self._own(job, pid)
            proc = self._forget(pid)
        self._stop(proc)

    @staticmethod
    def _stop(proc: BaseProcess | None) -> None:
        if proc is not None:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def close(self) -> None:
        """Stop serving and kill every worker this host started."""
        self._closed.set()
        _close_listener(self._sock)
        with self._lock:
            procs = list(self._procs.values())
            self._procs.clear()
            self._tags.clear()
        for proc in procs:
            self._stop(proc)


@dataclass(frozen=True)
class HostClient:
    """The runner's handle on one node's worker host, for one job."""

    address: tuple[str, int]
    authkey: bytes
    """The job's grant on that node (`protocol.worker_grant`)."""
    job_id: int
    runner_node: str
    timeout_s: float = 5.0

    def request(self, cmd: str, **kwargs: Any) -> Any:
        """One request; OSError if the host cannot be reached, refuses the key, or does not
        answer in time."""
        try:
            hello = {"job_id": self.job_id, "runner": self.runner_node}
            raw = _dial(self.address, self.authkey, self.timeout_s, hello)
        except mp.AuthenticationError as exc:
            raise OSError(f"worker host {self.address} refused the key ({exc})") from exc
        with contextlib.closing(raw):
            chan = PlainChannel(raw)
            chan.send((cmd, kwargs))
            if not chan.poll(self.timeout_s):
                raise OSError(f"worker host {self.address} did not answer {cmd!r}")
            status, value = chan.recv()
        if status != "ok":
            raise OSError(f"worker host {self.address}: {value}")
        return value


class RemoteProcess:
    """A worker process on another node, as far as the runner needs one (`BaseProcess`-like).

    Liveness is the host's word, asked at most once a second; a host that cannot be reached
    (its node died, the link is cut) makes its workers count as dead from then on.
    """

    def __init__(self, host: HostClient, pid: int) -> None:
        self.host = host
        self.pid = pid
        self.exitcode: int | None = None
        self._alive = True
        self._asked = 0.0

    def is_alive(self) -> bool:
        """Whether the worker still runs (cached for a second; dead is final)."""
        if self._alive and time.monotonic() - self._asked >= 1.0:
            self._asked = time.monotonic()
            try:
                self._alive = bool(self.host.request("alive", pid=self.pid))
            except (OSError, EOFError):
                self._alive = False
            if not self._alive:
                self.exitcode = -1
        return self._alive

    def join(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout`, else 10 s) until the worker has exited."""
        deadline = time.monotonic() + (10.0 if timeout is None else timeout)
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)

    def kill(self) -> None:
        """Have the host kill the worker (nothing if the host is gone: so is the worker)."""
        with contextlib.suppress(OSError, EOFError):
            self.host.request("kill", pid=self.pid)
        self._alive = False
        self.exitcode = -9


class Dialler:
    """The runner's listener that remote workers dial back to, matched by worker id, each
    authenticated with the grant of the node it was started on (`expect`)."""

    def __init__(self, host: str) -> None:
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._keys: dict[int, bytes] = {}
        self._arrived: dict[int, PlainChannel] = {}
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._accept, name="greenflow-dialler", daemon=True)
        self._thread.start()

    def expect(self, worker_id: int, authkey: bytes) -> None:
        """Let `worker_id` in when it proves `authkey` (called before its host starts it)."""
        with self._cond:
            self._keys[worker_id] = authkey

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock,), daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        conn = Connection(sock.detach())
        try:
            worker_id = int(_read_hello(conn, 30.0)["worker_id"])
            with self._cond:
                key = self._keys.get(worker_id)
            if key is None:
                raise ValueError(f"no worker {worker_id} is expected")
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
        except (OSError, EOFError, ValueError, KeyError, TypeError, mp.AuthenticationError):
            conn.close()
            return
        with self._cond:
            self._keys.pop(worker_id, None)
            self._arrived[worker_id] = PlainChannel(conn)
            self._cond.notify_all()

    def take(self, worker_id: int, timeout_s: float, proc: RemoteProcess) -> PlainChannel:
        """The channel of `worker_id` once it has dialled in; WorkerFailed if it never does."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while worker_id not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0 or not proc.is_alive():
                    self._keys.pop(worker_id, None)
                    raise WorkerFailed(
                        f"worker {worker_id} (pid {proc.pid} on {proc.host.address[0]}) never "
                        "connected back to the runner",
                        frozenset({worker_id}),
                    )
                self._cond.wait(min(left, 0.5))
            return self._arrived.pop(worker_id)

    def close(self) -> None:
        """Stop listening."""
        _close_listener(self._sock)


def _close_listener(sock: socket.socket) -> None:
    """Close a listening socket so that a thread blocked in its accept() returns at once."""
    # close() alone leaves accept() blocked on Linux until the next connection arrives.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def main(argv: list[str] | None = None) -> None:
    """Run a worker host (its node secret comes from GREENFLOW_WORKER_HOST_KEY)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--bind", required=True, help="address the other nodes reach")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    key = os.environ.get(HOST_KEY_ENV)
    if not key:
        sys.exit(f"{HOST_KEY_ENV} is not set")
    host = WorkerHost(args.bind, key.encode(), args.port)
    print(json.dumps({"host": args.bind, "port": host.port, "ifname": host.ifname}), flush=True)
    try:
        host.serve_forever()
    finally:
        host.close()


if __name__ == "__main__":
    main()
