"""A job's worker processes: spawn, pipe RPC, process-group generations, release and reaping.

Workers are spawned processes (one per GPU slot) driven over pipes; every command is answered
with `("ok", result)` or `("error", message)`. The pool hosts the TCPStore that every
process-group generation of the job uses.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

from worker_agent.runtime.errors import JobCodeFailed, WorkerFailed
from worker_agent.runtime.remote import Dialler, HostClient, RemoteProcess
from worker_agent.runtime.worker import Channel, WorkerConfig, worker_main

Call = tuple["WorkerHandle", str, dict[str, Any]]
"""(worker, command, keyword arguments) of one RPC."""


@dataclass(frozen=True, order=True)
class GpuSlot:
    """One GPU (or, without GPUs, one simulated slot) on a node."""

    node: str = "local"
    index: int = 0


@dataclass
class WorkerHandle:
    """The parent's end of one worker process."""

    worker_id: int
    slot: GpuSlot
    proc: BaseProcess | RemoteProcess
    conn: Channel
    pid: int = -1


@dataclass(frozen=True)
class PoolConfig:
    """What every worker of a job is started with."""

    spec_json: str
    backend: str
    store_host: str = "127.0.0.1"
    timeout_s: float = 60.0
    direct_min_run_bytes: int | None = None
    shared_state: bool = False
    stage_nice: int | None = None
    hosts: Mapping[str, HostClient] = field(default_factory=dict)
    """Worker hosts of the other nodes, by node name: slots on these nodes run there, every
    other slot here. With hosts, `store_host` must be an address those nodes reach."""
    socket_ifname: str | None = None
    """Interface this node's workers bind gloo/NCCL to (with hosts: the one peers reach)."""
    log_dir: str | None = None
    """Local workers append their stdout/stderr to `worker-<id>.log` here (None: inherited)."""
    remote_ready: bool = False
    """Listen for remote workers dialling back even while `hosts` is empty (hosts are added to
    the same mapping later, when the job grows onto other nodes)."""


class WorkerPool:
    """Spawns, drives and reaps one job's worker processes."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.timeout_s = config.timeout_s
        self._ctx = mp.get_context("spawn")
        self.store = dist.TCPStore(
            config.store_host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=config.timeout_s),
        )
        self._gen = 0
        self._next_id = 0
        self._reapers: list[threading.Thread] = []
        self._dialler = Dialler(config.store_host) if config.hosts or config.remote_ready else None
        self.setup: dict[str, Any] | None = None
        """Arguments of the `setup` command every new worker gets once it booted (module jobs:
        the model's geometry, worked out once by the first worker)."""

    def spawn(self, slots: Sequence[GpuSlot]) -> list[WorkerHandle]:
        """Start one worker per slot (here, or by its node's worker host) and wait until each
        has booted; WorkerFailed (the others stopped again) if one cannot be started."""
        cfg = self.config
        handles: list[WorkerHandle] = []
        remote: list[tuple[int, GpuSlot, RemoteProcess]] = []
        try:
            for slot in slots:
                wcfg = WorkerConfig(
                    worker_id=self._next_id,
                    spec_json=cfg.spec_json,
                    store_host=cfg.store_host,
                    store_port=self.store.port,
                    backend=cfg.backend,
                    device_index=slot.index if cfg.backend == "nccl" else None,
                    timeout_s=cfg.timeout_s,
                    direct_min_run_bytes=cfg.direct_min_run_bytes,
                    # Another node cannot map this node's shared memory.
                    shared_state=cfg.shared_state and slot.node not in cfg.hosts,
                    stage_nice=cfg.stage_nice,
                    socket_ifname=cfg.socket_ifname,
                    log_path=(
                        f"{cfg.log_dir}/worker-{self._next_id}.log"
                        if cfg.log_dir is not None and slot.node not in cfg.hosts
                        else None
                    ),
                )
                self._next_id += 1
                host = cfg.hosts.get(slot.node)
                if host is not None:
                    assert self._dialler is not None
                    # The worker dials back with the job's grant on its node.
                    self._dialler.expect(wcfg.worker_id, host.authkey)
                    try:
                        pid = host.request(
                            "spawn",
                            cfg=wcfg,
                            runner=self._dialler.address,
                            slot=slot.index,
                        )
                    except (OSError, EOFError) as exc:
                        raise WorkerFailed(
                            f"node {slot.node}: no worker started ({exc})",
                            frozenset({wcfg.worker_id}),
                        ) from exc
                    remote.append((wcfg.worker_id, slot, RemoteProcess(host, pid)))
                    continue
                parent, child = self._ctx.Pipe()
                proc = self._ctx.Process(target=worker_main, args=(child, wcfg), daemon=True)
                proc.start()
                child.close()
                handles.append(WorkerHandle(wcfg.worker_id, slot, proc, parent))
            for worker_id, slot, rproc in remote:
                assert self._dialler is not None
                chan = self._dialler.take(worker_id, self.timeout_s * 2, rproc)
                handles.append(WorkerHandle(worker_id, slot, rproc, chan, rproc.pid))
            for h in handles:
                h.pid = self.wait(h)
        except WorkerFailed:
            for h in handles:
                h.proc.kill()
                self.kill(h)
            for _, _, rproc in remote:
                rproc.kill()
            raise
        # Rank order follows the slots asked for, wherever each worker was started.
        order = {slot: i for i, slot in enumerate(slots)}
        handles.sort(key=lambda h: order[h.slot])
        if self.setup is not None and handles:
            self.call_all(handles, "setup", **self.setup)
        return handles

    def wait(self, h: WorkerHandle) -> Any:
        """One reply from a worker; WorkerFailed if it dies, errs, or times out."""
        deadline = time.monotonic() + self.timeout_s * 2
        gone = frozenset({h.worker_id})
        while True:
            try:
                if h.conn.poll(0.05):
                    status, value = h.conn.recv()
                    if status == "job_error":
                        raise JobCodeFailed(f"worker {h.worker_id} (pid {h.pid}): {value}")
                    if status != "ok":
                        raise WorkerFailed(f"worker {h.worker_id} (pid {h.pid}): {value}")
                    return value
            except (EOFError, OSError) as exc:
                h.proc.join(timeout=5)
                raise WorkerFailed(
                    f"worker {h.worker_id} (pid {h.pid}) died (exit code {h.proc.exitcode})", gone
                ) from exc
            if not h.proc.is_alive() and not h.conn.poll(0):
                raise WorkerFailed(
                    f"worker {h.worker_id} (pid {h.pid}) died (exit code {h.proc.exitcode})", gone
                )
            if time.monotonic() > deadline:
                raise WorkerFailed(f"worker {h.worker_id} (pid {h.pid}) timed out")

    def call(self, calls: Sequence[Call]) -> list[Any]:
        """Send every command first (collectives need all ranks), then collect every reply."""
        sent: list[WorkerHandle] = []
        errors: list[str] = []
        dead: set[int] = set()
        for h, cmd, kwargs in calls:
            try:
                h.conn.send((cmd, kwargs))
                sent.append(h)
            except OSError:
                errors.append(f"worker {h.worker_id} (pid {h.pid}) is gone")
                dead.add(h.worker_id)
        results: list[Any] = []
        job_code = False
        for h in sent:
            try:
                results.append(self.wait(h))
            except WorkerFailed as exc:
                errors.append(str(exc))
                dead |= exc.dead
                job_code |= isinstance(exc, JobCodeFailed)
                results.append(None)
        if errors:
            raise (JobCodeFailed if job_code else WorkerFailed)("; ".join(errors), frozenset(dead))
        return results

    def call_all(self, handles: Sequence[WorkerHandle], cmd: str, **kwargs: Any) -> list[Any]:
        """The same command with the same arguments to every worker in `handles`."""
        return self.call([(h, cmd, kwargs) for h in handles])

    def join(self, ranked: Sequence[WorkerHandle]) -> None:
        """Put `ranked` (by rank) into a fresh process-group generation."""
        self._gen += 1
        n = len(ranked)
        self.call(
            [
                (h, "join", {"generation": self._gen, "rank": r, "world_size": n})
                for r, h in enumerate(ranked)
            ]
        )

    def release(self, h: WorkerHandle, wait: bool = True) -> None:
        """Ask a worker to exit; with wait=False the process is reaped later by `reap`."""
        with contextlib.suppress(Exception):
            if h.proc.is_alive():
                h.conn.send(("exit", {}))
        if wait:
            self.reap(h)

    def reap_later(self, handles: list[WorkerHandle]) -> None:
        """Reap released workers in a thread (interpreter teardown takes ~1 s each)."""
        reaper = threading.Thread(target=self._reap_all, args=(handles,), name="greenflow-reaper")
        reaper.start()
        self._reapers.append(reaper)

    def _reap_all(self, handles: list[WorkerHandle]) -> None:
        for h in handles:
            self.reap(h)

    def reap(self, h: WorkerHandle) -> None:
        """Wait for a released worker to exit (kill it after 5 s) and close its pipe."""
        with contextlib.suppress(Exception):
            if h.proc.is_alive() and h.conn.poll(5):
                h.conn.recv()
        h.proc.join(timeout=5)
        if h.proc.is_alive():
            h.proc.kill()
            h.proc.join()
        h.conn.close()

    def kill(self, h: WorkerHandle) -> None:
        """Make sure a failed worker's process is gone (wait 5 s, then kill) and close its pipe."""
        h.proc.join(timeout=5)
        if h.proc.is_alive():
            h.proc.kill()
            h.proc.join()
        h.conn.close()

    def close(self, handles: Sequence[WorkerHandle]) -> None:
        """Release `handles` and wait for every reaper."""
        for h in handles:
            self.release(h)
        for t in self._reapers:
            t.join()
        self._reapers = []
        if self._dialler is not None:
            self._dialler.close()
            self._dialler = None
