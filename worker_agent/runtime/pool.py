"""The parent-side API: `JobRunner` starts a job's workers, trains, resizes (hot switch), stops.

One `JobRunner` per job, in the agent process. Workers are spawned processes (one per GPU slot)
driven over pipes; the runner hosts the TCPStore that every process-group generation uses.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import torch
import torch.distributed as dist

from worker_agent.hotswitch.execute import ExecStats
from worker_agent.hotswitch.plan import PlanError, SwitchPlan, build_plan
from worker_agent.runtime.errors import LayoutError, SwitchFailed, WorkerFailed
from worker_agent.runtime.layout import Layout, choose_layout
from worker_agent.runtime.presets import JobSpec, build_job, model_shape
from worker_agent.runtime.shards import Holding, shard_map
from worker_agent.runtime.worker import StepStats, WorkerConfig, worker_main


@dataclass(frozen=True, order=True)
class GpuSlot:
    """One GPU (or, without GPUs, one simulated slot) on a node."""

    node: str = "local"
    index: int = 0


@dataclass
class SwitchReport:
    """What one resize did and what it cost."""

    src: Layout
    dst: Layout
    step: int
    ok: bool
    switch_s: float
    """Training paused: (snapshot copy) + transfer + commit + group rebuild."""
    spawn_s: float
    """Starting new workers; overlaps training (not part of switch_s)."""
    snapshot_s: float
    plan_s: float
    """Planning in the runner; before the pause, overlaps training (not part of switch_s)."""
    transfer_s: float
    regroup_s: float
    bytes_moved: int
    bytes_lower_bound: int
    bytes_local: int
    max_send_bytes: int
    pack_s: float
    comm_s: float
    unpack_s: float
    exchange_s: float
    """Slowest worker's pack + batched p2p + unpack: the time the moved bytes took."""
    local_s: float
    """Slowest worker's copies of what it already held (run while its messages are in flight)."""
    stage_s: float = 0.0
    """Staging before the pause (messages worked out, new buffers allocated and pre-faulted) as
    the runner waited for it; overlaps training (not part of switch_s)."""
    stage_wait_s: float = 0.0
    """Slowest worker's staging still unfinished when the pause began (part of switch_s)."""
    pair_bytes: list[tuple[int, int, int]] = field(default_factory=list)
    """(sender, receiver, bytes) per worker pair, ranks as in the transfer group."""
    bytes_pulled: int = 0
    """Part of bytes_moved that receivers copied out of their senders' shared-memory state
    (same node, CPU; no message); the rest travelled as p2p messages."""
    messages: int = 0
    """p2p messages posted, all workers together (a send and its receive count twice)."""
    workers_started: list[int] = field(default_factory=list)
    workers_released: list[int] = field(default_factory=list)
    stage_profile: list[dict[str, dict[str, float]]] = field(default_factory=list)
    """Per worker (transfer-group rank order): its staging thread's time per phase (wall, user
    and sys CPU, run-queue wait, page faults, context switches; see `PhaseProfile`)."""
    error: str | None = None
    recovered_from: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    """Per-rank checkpoint files of one layout at one step."""

    layout: Layout
    step: int
    files: list[str]


@dataclass
class Progress:
    """Training progress as the agent reports it."""

    step: int
    samples_per_s: float
    loss: float | None
    layout: Layout
    worker_pids: list[int]
    """By rank in the current layout."""
    step_at: float = 0.0
    """`time.perf_counter()` when training reached `step` (end of the last chunk)."""


@dataclass
class _Handle:
    worker_id: int
    slot: GpuSlot
    proc: BaseProcess
    conn: Connection
    pid: int = -1


def _holdings(job_specs: Any, n_blocks: int, layout: Layout, rank: int) -> list[Holding]:
    return shard_map(job_specs, n_blocks, layout, rank).holdings()


def _overlap(a: list[Holding], b: list[Holding]) -> int:
    """Elements of `b` that are already in `a` (same logical tensor ranges)."""
    idx: dict[str, list[Holding]] = {}
    for h in a:
        idx.setdefault(h.tensor, []).append(h)
    total = 0
    for h in b:
        for g in idx.get(h.tensor, []):
            total += max(0, min(g.end, h.end) - max(g.start, h.start))
    return total


class JobRunner:
    """Runs one job on a pool of worker processes and hot-switches its layout on resize."""

    def __init__(
        self,
        snapshot_policy: Literal["auto", "before_switch", "periodic", "none"] = "auto",
        timeout_s: float = 60.0,
        backend: str | None = None,
        store_host: str = "127.0.0.1",
        direct_min_run_bytes: int | None = None,
        snapshot_every_steps: int = 50,
        transport: Literal["auto", "p2p"] = "auto",
        stage_nice: int | None = None,
    ) -> None:
        """Snapshot policies (what a switch can fall back to when a unique holder dies):

        `auto`: CPU workers keep their state in shared memory that the runner maps, so the
        state at the switch survives a worker's death without any copy; on GPUs a copy to host
        memory every `snapshot_every_steps` steps, between training chunks (never in a switch).
        `before_switch`: the state at the switch (shared memory on CPU; on GPUs a copy taken in
        the pause). `periodic`: the GPU behaviour of `auto` everywhere. `none`: nothing.

        `transport="auto"`: where a switch's sender and receiver are on one node and the
        sender's state is in shared memory (CPU with `auto`/`before_switch`), the receiver
        copies straight out of the sender's buffer; every other pair (and all with `"p2p"`)
        exchanges batched p2p messages.

        `stage_nice`: on CPU workers the staging thread (page faults before the pause) runs at
        this nice value, so that it takes the cores when training waits; None (default) keeps
        it at the training thread's priority. Measured at 100 M (docs/hotswitch.md): 19 cut
        the training lost in the heaviest switch and raised it in the light ones, and made
        staging 3-20x longer, so it is off by default.
        """
        self.stage_nice = stage_nice
        self.snapshot_policy = snapshot_policy
        self.direct_min_run_bytes = direct_min_run_bytes
        self.snapshot_every_steps = snapshot_every_steps
        self.transport = transport
        self.timeout_s = timeout_s
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        # GPU memory dies with its process, so only CPU state can be shared with the runner.
        self._shared_state = self.backend != "nccl" and snapshot_policy in ("auto", "before_switch")
        self._live: dict[int, tuple[torch.Tensor, Layout, int]] = {}
        self._snapshot_step: int | None = None
        self._switch_id = 0
        self.store_host = store_host
        self._ctx = mp.get_context("spawn")
        self._store: dist.TCPStore | None = None
        self._gen = 0
        self._next_id = 0
        self._ranks: list[_Handle] = []
        self._layout: Layout | None = None
        self._spec: JobSpec | None = None
        self._step = 0
        self._step_at = 0.0
        self._loss: float | None = None
        self._samples_per_s = 0.0
        self._snapshot: dict[int, tuple[torch.Tensor, Layout, int, int]] = {}
        self._lock = threading.RLock()
        self._switch_waiting = threading.Event()
        self._lock_wanted = threading.Event()
        """Set while resize() waits for the lock between two chunks (the lock is not fair)."""
        self._stop = threading.Event()
        self._driver: threading.Thread | None = None
        self._driver_error: BaseException | None = None
        self._reapers: list[threading.Thread] = []

    # ----- public API -----------------------------------------------------------------------
    def start(
        self,
        job_spec: JobSpec,
        gpus: Sequence[GpuSlot] | int,
        layout: Layout | None = None,
        memory_per_gpu_bytes: float = 64 * 2**30,
        gpus_per_node: int | None = None,
        checkpoint: Checkpoint | None = None,
        state: tuple[dict[str, torch.Tensor], int] | None = None,
    ) -> Layout:
        """Start one worker per GPU slot in `layout` (or the chosen one).

        State is fresh, or read from `checkpoint` files, or taken from `state` = (the full
        logical tensors as `gather_state()` returns them, the optimizer step they belong to).
        """
        if self._ranks:
            raise RuntimeError("job already started; use resize() or stop()")
        slots = self._slots(gpus)
        self._spec = job_spec
        self._memory_per_gpu_bytes = memory_per_gpu_bytes
        self._gpus_per_node = gpus_per_node
        job = build_job(job_spec)
        self._param_specs = job.param_specs()
        self._n_blocks = job.n_blocks()
        layout = layout or self._choose(len(slots))
        if layout.world_size != len(slots):
            raise LayoutError(f"layout {layout} needs {layout.world_size} GPUs, got {len(slots)}")
        self._store = dist.TCPStore(
            self.store_host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.timeout_s),
        )
        handles = self._spawn(slots)
        self._ranks = handles
        self._join(handles)
        self._layout = layout
        self._step = 0
        if state is not None:
            tensors, step = state
            calls = []
            for r, h in enumerate(handles):
                smap = shard_map(self._param_specs, self._n_blocks, layout, r)
                flat = torch.empty(smap.n_state_elems)
                for hold in smap.holdings():
                    flat[hold.offset : hold.offset + hold.numel].copy_(
                        tensors[hold.tensor][hold.start : hold.end]
                    )
                calls.append(
                    (h, "restore", {"snap": flat, "layout": layout, "rank": r, "step": step})
                )
            self._call(calls)
            self._step = step
            self._refresh_live()
            return layout
        if checkpoint is None:
            self._call(
                [(h, "init_state", {"layout": layout, "rank": r}) for r, h in enumerate(handles)]
            )
            self._refresh_live()
            return layout
        # Resharding on load: the planner maps checkpoint files (ids -1, -2, ...) to new ranks.
        src = {
            -1 - k: _holdings(self._param_specs, self._n_blocks, checkpoint.layout, k)
            for k in range(checkpoint.layout.world_size)
        }
        dst = {
            h.worker_id: _holdings(self._param_specs, self._n_blocks, layout, r)
            for r, h in enumerate(handles)
        }
        plan = build_plan(src, dst)
        files = {-1 - k: f for k, f in enumerate(checkpoint.files)}
        self._call(
            [
                (h, "load_checkpoint", {"layout": layout, "rank": r, "plan": plan, "files": files})
                for r, h in enumerate(handles)
            ]
        )
        self._step = checkpoint.step
        self._refresh_live()
        return layout

    def save_checkpoint(self, directory: str) -> Checkpoint:
        """Every worker writes its shard to `directory` (the restart baseline; not used by resize)."""
        files = [f"{directory}/rank{r}.pt" for r in range(len(self._ranks))]
        with self._lock:
            self._call(
                [
                    (h, "save_checkpoint", {"path": f})
                    for h, f in zip(self._ranks, files, strict=True)
                ]
            )
        return Checkpoint(self.layout, self._step, files)

    def probe_p2p(
        self, pairs: list[tuple[int, int, int]], repeats: int = 3, fresh: bool = False
    ) -> float:
        """Median seconds of a plain batched p2p copy of (src_rank, dst_rank, bytes)."""
        elems = [(s, d, n // 4) for s, d, n in pairs]
        with self._lock:
            times = self._call(
                [
                    (h, "p2p_probe", {"pairs": elems, "repeats": repeats, "fresh": fresh})
                    for h in self._ranks
                ]
            )
        return float(max(times))

    def probe_shm_copy(self, pairs: list[tuple[int, int, int]], repeats: int = 3) -> float:
        """Median seconds of a plain shared-memory copy of (src_rank, dst_rank, bytes): each
        receiver copies its pairs out of buffers its senders allocated, all receivers at once."""
        elems = [(s, d, n // 4) for s, d, n in pairs]
        with self._lock:
            bufs = self._call([(h, "shm_probe_buffers", {"pairs": elems}) for h in self._ranks])
            it = {r: iter(b) for r, b in enumerate(bufs)}
            sources = [next(it[s]) for s, _, _ in elems]
            times = self._call(
                [
                    (
                        h,
                        "shm_probe",
                        {
                            "pairs": elems,
                            # Each receiver maps only the buffers it copies from.
                            "sources": [
                                t if d == r else None
                                for t, (_, d, _) in zip(sources, elems, strict=True)
                            ],
                            "repeats": repeats,
                        },
                    )
                    for r, h in enumerate(self._ranks)
                ]
            )
        return float(max(times))

    @property
    def layout(self) -> Layout:
        """The current layout."""
        if self._layout is None:
            raise RuntimeError("job not started")
        return self._layout

    def worker_pids(self) -> list[int]:
        """Worker process ids by rank."""
        return [h.pid for h in self._ranks]

    def slots(self) -> list[GpuSlot]:
        """GPU slots by rank."""
        return [h.slot for h in self._ranks]

    def train(self, steps: int) -> list[tuple[int, float]]:
        """Run `steps` steps now (blocking); returns (step, loss) per step."""
        with self._lock:
            return self._train(steps)

    def run_background(self, steps_per_chunk: int = 1, max_steps: int | None = None) -> None:
        """Train in a background thread until stop() (or max_steps); resize() interleaves."""
        if self._driver is not None and self._driver.is_alive():
            return
        self._stop.clear()

        def loop() -> None:
            try:
                while not self._stop.is_set():
                    if max_steps is not None and self._step >= max_steps:
                        break
                    if self._switch_waiting.is_set():
                        time.sleep(0.01)
                        continue
                    if self._lock_wanted.is_set():
                        time.sleep(0.001)
                        continue
                    with self._lock:
                        n = steps_per_chunk
                        if max_steps is not None:
                            n = min(n, max_steps - self._step)
                        self._train(n)
            except BaseException as exc:  # surfaced by step_progress()/stop()
                self._driver_error = exc

        self._driver = threading.Thread(target=loop, name="greenflow-job-driver", daemon=True)
        self._driver.start()

    def pause(self) -> None:
        """Stop the background driver after its current chunk (workers stay up)."""
        self._stop.set()
        if self._driver is not None:
            self._driver.join()
            self._driver = None
        if self._driver_error is not None:
            err, self._driver_error = self._driver_error, None
            raise WorkerFailed(f"training driver failed: {err}") from err

    def step_progress(self) -> Progress:
        """Current step, samples/s of the last chunk, last loss, layout and worker pids."""
        if self._driver_error is not None:
            raise WorkerFailed(f"training driver failed: {self._driver_error}")
        return Progress(
            self._step,
            self._samples_per_s,
            self._loss,
            self.layout,
            self.worker_pids(),
            self._step_at,
        )

    def resize(
        self, new_gpus: Sequence[GpuSlot] | int, layout: Layout | None = None
    ) -> SwitchReport:
        """Hot-switch to `new_gpus` (kept slots keep their worker process) and a new layout."""
        slots = self._slots(new_gpus)
        old_layout = self.layout
        new_layout = layout or self._choose(len(slots))
        if new_layout.world_size != len(slots):
            raise LayoutError(
                f"layout {new_layout} needs {new_layout.world_size} GPUs, got {len(slots)}"
            )
        current = {h.slot: h for h in self._ranks}
        keep = [current[s] for s in slots if s in current]
        leaving = [h for h in self._ranks if h.slot not in slots]
        old = list(self._ranks)
        t0 = time.perf_counter()
        # Everything up to the pause overlaps training: new workers boot (import torch, connect
        # to the store), the runner plans, every worker stages (allocates and pre-faults).
        added = self._spawn([s for s in slots if s not in current])
        spawn_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        target = self._assign_ranks(old_layout, new_layout, keep, added)
        plan = self._plan(old_layout, new_layout, old, target, added)
        plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._switch_id += 1
        self._stage(plan, old, target, added, new_layout)
        stage_s = time.perf_counter() - t0
        self._switch_waiting.set()
        try:
            with self._lock:
                report = self._switch(
                    old_layout,
                    new_layout,
                    old,
                    target,
                    leaving,
                    added,
                    plan,
                    (spawn_s, plan_s, stage_s),
                )
        finally:
            self._switch_waiting.clear()
        if self._driver is None or not self._driver.is_alive():
            # Not training: free the replaced state now rather than at the next command (a
            # training driver's next chunk frees it in a thread instead).
            with self._lock:
                self._call([(h, "free_retired", {}) for h in self._ranks])
        return report

    def gather_state(self) -> dict[str, torch.Tensor]:
        """Full logical tensors (`param/…`, `exp_avg/…`, `exp_avg_sq/…`) assembled from shards.

        Raises WorkerFailed if two replicas of the same elements differ bitwise.
        """
        with self._lock:
            parts = self._call([(h, "shards", {}) for h in self._ranks])
        sizes = {p.name: p.numel for p in self._param_specs}
        out: dict[str, torch.Tensor] = {}
        filled: dict[str, torch.Tensor] = {}
        for shards in parts:
            for name, (start, end, data) in shards.items():
                full = out.setdefault(name, torch.zeros(sizes[name.split("/", 1)[1]]))
                mask = filled.setdefault(name, torch.zeros(full.numel(), dtype=torch.bool))
                seen = mask[start:end]
                if seen.any() and not torch.equal(full[start:end][seen], data[seen]):
                    raise WorkerFailed(f"replicas of {name} disagree")
                full[start:end] = data
                mask[start:end] = True
        return out

    def arm_fault(
        self,
        rank: int,
        mode: Literal["switch", "transfer", "stage", "commit", "regroup"] = "switch",
    ) -> None:
        """Test hook: in the next switch the worker at `rank` exits in the pause (`switch`),
        raises in its transfer (`transfer`), exits while staging before the pause (`stage`),
        exits when told to commit (`commit`), or exits when told to rebuild its process groups
        after its commit (`regroup`: the new generation's `join`, or `build_groups`)."""
        self._call([(self._ranks[rank], "arm_fault", {"mode": mode})])

    def stop(self) -> None:
        """Stop training and release every worker."""
        with contextlib.suppress(WorkerFailed):
            self.pause()
        for h in self._ranks:
            self._release(h)
        for t in self._reapers:
            t.join()
        self._reapers = []
        self._ranks = []
        self._layout = None
        self._snapshot = {}
        self._live = {}
        self._snapshot_step = None
        self._store = None

    def __enter__(self) -> JobRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- internals ------------------------------------------------------------------------
    def _choose(self, gpus: int) -> Layout:
        assert self._spec is not None
        shape = model_shape(build_job(self._spec), self._spec)
        return choose_layout(shape, gpus, self._memory_per_gpu_bytes, self._gpus_per_node)

    @staticmethod
    def _slots(gpus: Sequence[GpuSlot] | int) -> list[GpuSlot]:
        slots = [GpuSlot("local", i) for i in range(gpus)] if isinstance(gpus, int) else list(gpus)
        if not slots or len(set(slots)) != len(slots):
            raise LayoutError(f"need a non-empty list of distinct GPU slots, got {gpus!r}")
        return slots

    def _spawn(self, slots: Sequence[GpuSlot]) -> list[_Handle]:
        assert self._store is not None and self._spec is not None
        handles: list[_Handle] = []
        for slot in slots:
            parent, child = self._ctx.Pipe()
            cfg = WorkerConfig(
                worker_id=self._next_id,
                spec_json=self._spec.model_dump_json(),
                store_host=self.store_host,
                store_port=self._store.port,
                backend=self.backend,
                device_index=slot.index if self.backend == "nccl" else None,
                timeout_s=self.timeout_s,
                direct_min_run_bytes=self.direct_min_run_bytes,
                shared_state=self._shared_state,
                stage_nice=self.stage_nice,
            )
            self._next_id += 1
            proc = self._ctx.Process(target=worker_main, args=(child, cfg), daemon=True)
            proc.start()
            child.close()
            handles.append(_Handle(cfg.worker_id, slot, proc, parent))
        for h in handles:
            h.pid = self._wait(h)
        return handles

    def _wait(self, h: _Handle) -> Any:
        """One reply from a worker; WorkerFailed if it dies, errs, or times out."""
        deadline = time.monotonic() + self.timeout_s * 2
        gone = frozenset({h.worker_id})
        while True:
            try:
                if h.conn.poll(0.05):
                    status, value = h.conn.recv()
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

    def _call(self, calls: Sequence[tuple[_Handle, str, dict[str, Any]]]) -> list[Any]:
        """Send every command first (collectives need all ranks), then collect every reply."""
        sent: list[_Handle] = []
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
        for h in sent:
            try:
                results.append(self._wait(h))
            except WorkerFailed as exc:
                errors.append(str(exc))
                dead |= exc.dead
                results.append(None)
        if errors:
            raise WorkerFailed("; ".join(errors), frozenset(dead))
        return results

    def _join(self, ranked: Sequence[_Handle]) -> None:
        """Put `ranked` (by rank) into a fresh process-group generation."""
        self._gen += 1
        n = len(ranked)
        self._call(
            [
                (h, "join", {"generation": self._gen, "rank": r, "world_size": n})
                for r, h in enumerate(ranked)
            ]
        )

    def _train(self, steps: int) -> list[tuple[int, float]]:
        assert self._spec is not None
        t0 = time.perf_counter()
        per_worker: list[list[StepStats]] = self._call(
            [(h, "train", {"steps": steps}) for h in self._ranks]
        )
        wall_s = time.perf_counter() - t0
        out: list[tuple[int, float]] = []
        for i in range(steps):
            parts = [w[i].loss_part for w in per_worker]
            out.append((per_worker[0][i].step, float(sum(p for p in parts if p is not None))))
        self._step += steps
        self._step_at = time.perf_counter()
        self._loss = out[-1][1] if out else self._loss
        self._samples_per_s = self._spec.global_batch_size * steps / wall_s if wall_s > 0 else 0.0
        if (
            self.snapshot_policy in ("auto", "periodic")
            and not self._shared_state
            and (
                self._snapshot_step is None
                or self._step - self._snapshot_step >= self.snapshot_every_steps
            )
        ):
            # Between chunks, never inside a switch: the fallback if a unique holder dies.
            snaps = self._call([(h, "snapshot", {}) for h in self._ranks])
            self._snapshot = {h.worker_id: s for h, s in zip(self._ranks, snaps, strict=True)}
            self._snapshot_step = self._step
        return out

    def _release(self, h: _Handle, wait: bool = True) -> None:
        """Ask a worker to exit; with wait=False the process is reaped later by `_reap`."""
        with contextlib.suppress(Exception):
            if h.proc.is_alive():
                h.conn.send(("exit", {}))
        if wait:
            self._reap(h)

    def _reap_all(self, handles: list[_Handle]) -> None:
        for h in handles:
            self._reap(h)

    def _reap(self, h: _Handle) -> None:
        with contextlib.suppress(Exception):
            if h.proc.is_alive() and h.conn.poll(5):
                h.conn.recv()
        h.proc.join(timeout=5)
        if h.proc.is_alive():
            h.proc.kill()
            h.proc.join()
        h.conn.close()

    def _assign_ranks(
        self, old_layout: Layout, new_layout: Layout, keep: list[_Handle], added: list[_Handle]
    ) -> list[_Handle]:
        """Give each new rank the kept worker that already holds most of its shard."""
        old_rank = {h.worker_id: r for r, h in enumerate(self._ranks)}
        held = {
            h.worker_id: _holdings(
                self._param_specs, self._n_blocks, old_layout, old_rank[h.worker_id]
            )
            for h in keep
        }
        free = list(keep)
        ranked: list[_Handle | None] = []
        for r in range(new_layout.world_size):
            need = _holdings(self._param_specs, self._n_blocks, new_layout, r)
            if free:
                best = max(
                    free, key=lambda h: (_overlap(held[h.worker_id], need), -old_rank[h.worker_id])
                )
                if _overlap(held[best.worker_id], need) > 0 or not added:
                    free.remove(best)
                    ranked.append(best)
                    continue
            ranked.append(None)
        spare = iter([*free, *added])
        return [h if h is not None else next(spare) for h in ranked]

    def _plan(
        self,
        old_layout: Layout,
        new_layout: Layout,
        old: list[_Handle],
        target: list[_Handle],
        added: list[_Handle],
    ) -> SwitchPlan:
        src = {
            h.worker_id: _holdings(self._param_specs, self._n_blocks, old_layout, r)
            for r, h in enumerate(old)
        }
        dst = {
            h.worker_id: _holdings(self._param_specs, self._n_blocks, new_layout, r)
            for r, h in enumerate(target)
        }
        node_of = {h.worker_id: h.slot.node for h in [*old, *added]}
        return build_plan(src, dst, node_of)

    def _stage(
        self,
        plan: SwitchPlan,
        old: list[_Handle],
        target: list[_Handle],
        added: list[_Handle],
        new_layout: Layout,
    ) -> None:
        """Have every worker stage its part (threads, training goes on) and wait until done.

        A worker that dies or fails here is not handled here: the paused part of the switch
        meets the same failure and rolls back.
        """
        assert self._store is not None
        new_rank = {h.worker_id: r for r, h in enumerate(target)}
        keys = {h.worker_id: f"stage/{self._switch_id}/{h.worker_id}" for h in [*old, *added]}
        pulls = self._pull_pairs(plan, [*old, *added])

        def calls(hs: list[_Handle]) -> list[tuple[_Handle, str, dict[str, Any]]]:
            return [
                (
                    h,
                    "switch_stage",
                    {
                        "switch_id": self._switch_id,
                        "plan": plan.part_for(h.worker_id),
                        "new_layout": new_layout if h.worker_id in new_rank else None,
                        "new_rank": new_rank.get(h.worker_id, -1),
                        "done_key": keys[h.worker_id],
                        "prebuild_groups": self._prebuild_groups(old, target, [], added),
                        "peer_flats": {s: self._live[s][0] for s, d in pulls if d == h.worker_id},
                        "pull_pairs": frozenset(p for p in pulls if h.worker_id in p),
                    },
                )
                for h in hs
            ]

        with contextlib.suppress(WorkerFailed):
            self._call(calls(added))  # not yet driven by the training thread: no lock needed
            # Waits for the current training chunk; the command returns at once. Without the
            # flag the driver thread took the lock back for its next chunk, again and again:
            # staging started 1-5 chunks late (measured: 8.6 s at 100 M).
            self._lock_wanted.set()
            try:
                with self._lock:
                    self._lock_wanted.clear()
                    self._call(calls(old))
            finally:
                self._lock_wanted.clear()
        deadline = time.monotonic() + self.timeout_s
        handles = [*old, *added]
        while not self._store.check(list(keys.values())):
            if time.monotonic() > deadline or not all(h.proc.is_alive() for h in handles):
                return
            # Not faster: each check is a store round trip through the runner's own TCPStore
            # server, on the cores training uses (this wait lasts seconds on a busy CPU host).
            time.sleep(0.02)

    def _pull_pairs(self, plan: SwitchPlan, handles: list[_Handle]) -> frozenset[tuple[int, int]]:
        """(sender, receiver) pairs where the receiver copies out of the sender's shared state."""
        if self.transport != "auto" or not self._shared_state:
            return frozenset()
        node = {h.worker_id: h.slot.node for h in handles}
        return frozenset(
            (t.src, t.dst)
            for t in plan.transfers
            if t.src in self._live and node.get(t.src) == node.get(t.dst)
        )

    @staticmethod
    def _prebuild_groups(
        old: list[_Handle], target: list[_Handle], leaving: list[_Handle], added: list[_Handle]
    ) -> bool:
        """True when the process group does not change, so sub-groups can form while staging."""
        same = [h.worker_id for h in old] == [h.worker_id for h in target]
        return same and not leaving and not added

    def _refresh_live(self) -> None:
        """Keep the shared-memory handles of every worker's current state."""
        self._live = {}
        if not self._shared_state:
            return
        handles = self._call([(h, "state_handle", {}) for h in self._ranks])
        self._live = {
            h.worker_id: v for h, v in zip(self._ranks, handles, strict=True) if v is not None
        }

    def _switch(
        self,
        old_layout: Layout,
        new_layout: Layout,
        old: list[_Handle],
        target: list[_Handle],
        leaving: list[_Handle],
        added: list[_Handle],
        plan: SwitchPlan,
        before_pause: tuple[float, float, float],
    ) -> SwitchReport:
        spawn_s, plan_s, stage_s = before_pause
        prebuilt = self._prebuild_groups(old, target, leaving, added)
        t_start = time.perf_counter()
        snapshot_s = 0.0
        if self._shared_state and len(self._live) == len(old):
            # The state at the switch, kept without a copy: the old buffers are only read until
            # commit, and the runner's handles keep them alive if a worker dies.
            self._snapshot = {
                wid: (t, lay, rank, self._step) for wid, (t, lay, rank) in self._live.items()
            }
        elif self.snapshot_policy == "before_switch":
            t0 = time.perf_counter()
            snaps = self._call([(h, "snapshot", {}) for h in old])
            self._snapshot = {h.worker_id: s for h, s in zip(old, snaps, strict=True)}
            snapshot_s = time.perf_counter() - t0
        elif self.snapshot_policy == "none":
            self._snapshot = {}
        # Otherwise (periodic) the last periodic snapshot of this layout stays the fallback.

        new_rank = {h.worker_id: r for r, h in enumerate(target)}
        if added and leaving:
            union = [*old, *added]
        elif added:
            union = target
        else:
            union = old
        transfer_s = regroup_s = 0.0
        stats: list[ExecStats] = []
        try:
            gone = frozenset(h.worker_id for h in union if not h.proc.is_alive())
            if gone:
                # Lost while staging: roll back now rather than wait for a rendezvous (or a
                # transfer) with a dead process to time out.
                raise WorkerFailed(f"workers {sorted(gone)} died while staging the switch", gone)
            t0 = time.perf_counter()
            if added:
                self._join(union)
            regroup_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            group_rank = {h.worker_id: r for r, h in enumerate(union)}
            stats = self._call(
                [
                    (
                        h,
                        "switch_prepare",
                        {
                            # Staged before the pause: the plan need not travel again.
                            "plan": None,
                            "group_rank": group_rank,
                            "new_layout": new_layout if h.worker_id in new_rank else None,
                            "new_rank": new_rank.get(h.worker_id, -1),
                            "step": self._step,
                            "switch_id": self._switch_id,
                        },
                    )
                    for h in union
                ]
            )
            transfer_s = time.perf_counter() - t0
        except WorkerFailed as exc:
            return self._rollback(
                old_layout, new_layout, old, added, plan, exc, t_start, spawn_s, snapshot_s, plan_s
            )

        t0 = time.perf_counter()
        same_group = [h.worker_id for h in union] == [h.worker_id for h in target]
        try:
            # Two-phase: a worker keeps the state its commit replaced (references, no copy) until
            # the switch is final, i.e. until its first command after the pause. A worker lost
            # from here to the end of the group rebuild therefore still rolls back like one lost
            # in the transfer: `switch_abort` puts the survivors back in the old layout.
            handles = self._call([(h, "switch_commit", {}) for h in union])
            if not same_group:
                gone = frozenset(h.worker_id for h in union if not h.proc.is_alive())
                if gone:
                    # Caught before the rendezvous, which would wait for it until timeout_s.
                    raise WorkerFailed(f"workers {sorted(gone)} died in the commit", gone)
                self._join(target)
            if not prebuilt:
                self._call([(h, "build_groups", {}) for h in target])
        except WorkerFailed as exc:
            return self._rollback(
                old_layout, new_layout, old, added, plan, exc, t_start, spawn_s, snapshot_s, plan_s
            )
        self._ranks = target
        self._layout = new_layout
        regroup_s += time.perf_counter() - t0
        # Leavers exit only now: their interpreter teardown (~1 s of CPU) would otherwise compete
        # with the survivors' new process group for the same cores inside the pause.
        for h in leaving:
            self._release(h, wait=False)
        report = self._report(
            old_layout,
            new_layout,
            plan,
            stats,
            True,
            t_start,
            spawn_s,
            snapshot_s,
            plan_s,
            transfer_s,
            regroup_s,
            added,
            leaving,
            group_rank=group_rank,
            stage_s=stage_s,
        )
        # Handles of the new state; the old buffers are freed once nobody maps them (below).
        retired = [self._live, self._snapshot]
        self._live = {
            h.worker_id: v
            for h, v in zip(union, handles, strict=True)
            if v is not None and h.worker_id in new_rank
        }
        if self._shared_state:
            self._snapshot = {}
        if self.snapshot_policy != "none" and not self._shared_state:
            self._snapshot = {}  # a snapshot of the old layout cannot be restored in the new one
            self._snapshot_step = None
        # Reaping exited workers takes ~1 s of interpreter teardown; training need not wait for it.
        if leaving:
            reaper = threading.Thread(
                target=self._reap_all, args=(leaving,), name="greenflow-reaper"
            )
            reaper.start()
            self._reapers.append(reaper)
        # Unmapping the old state takes tens of ms; after the pause, in a thread.
        threading.Thread(target=retired.clear, name="greenflow-free", daemon=True).start()
        return report

    def _report(
        self,
        src: Layout,
        dst: Layout,
        plan: SwitchPlan,
        stats: list[ExecStats],
        ok: bool,
        t_start: float,
        spawn_s: float,
        snapshot_s: float,
        plan_s: float,
        transfer_s: float,
        regroup_s: float,
        added: list[_Handle],
        leaving: list[_Handle],
        error: str | None = None,
        recovered_from: str | None = None,
        group_rank: dict[int, int] | None = None,
        stage_s: float = 0.0,
    ) -> SwitchReport:
        pairs: dict[tuple[int, int], int] = {}
        if group_rank is not None:
            for t in plan.transfers:
                key = (group_rank[t.src], group_rank[t.dst])
                pairs[key] = pairs.get(key, 0) + t.numel * plan.elem_bytes
        pair_bytes = [(s, d, n) for (s, d), n in sorted(pairs.items())]
        return SwitchReport(
            src=src,
            dst=dst,
            step=self._step,
            ok=ok,
            switch_s=time.perf_counter() - t_start,
            spawn_s=spawn_s,
            snapshot_s=snapshot_s,
            plan_s=plan_s,
            transfer_s=transfer_s,
            regroup_s=regroup_s,
            bytes_moved=plan.bytes_moved,
            bytes_lower_bound=plan.bytes_lower_bound,
            bytes_local=sum(s.bytes_local for s in stats),
            max_send_bytes=plan.max_send_bytes,
            pack_s=max((s.pack_s for s in stats), default=0.0),
            comm_s=max((s.comm_s for s in stats), default=0.0),
            unpack_s=max((s.unpack_s for s in stats), default=0.0),
            exchange_s=max((s.pack_s + s.comm_s + s.unpack_s for s in stats), default=0.0),
            local_s=max((s.local_s for s in stats), default=0.0),
            stage_s=stage_s,
            stage_wait_s=max((s.stage_wait_s for s in stats), default=0.0),
            pair_bytes=pair_bytes,
            bytes_pulled=sum(s.bytes_pulled for s in stats),
            messages=sum(s.messages for s in stats),
            workers_started=[h.pid for h in added],
            workers_released=[h.pid for h in leaving],
            stage_profile=[s.stage_profile for s in stats],
            error=error,
            recovered_from=recovered_from,
        )

    def _rollback(
        self,
        old_layout: Layout,
        new_layout: Layout,
        old: list[_Handle],
        added: list[_Handle],
        plan: SwitchPlan,
        exc: WorkerFailed,
        t_start: float,
        spawn_s: float,
        snapshot_s: float,
        plan_s: float,
    ) -> SwitchReport:
        """Return to the old layout: replace dead workers, repair from replicas or the snapshot."""
        for h in added:
            self._release(h)
        gone = set(exc.dead)
        try:
            self._call([(h, "switch_abort", {}) for h in old if h.worker_id not in gone])
        except WorkerFailed as abort_exc:
            gone |= abort_exc.dead
        dead = [h for h in old if h.worker_id in gone or not h.proc.is_alive()]
        for h in dead:
            h.proc.join(timeout=5)
            if h.proc.is_alive():
                h.proc.kill()
                h.proc.join()
        replacements = self._spawn([h.slot for h in dead])
        by_id = {d.worker_id: r for d, r in zip(dead, replacements, strict=True)}
        ranked = [by_id.get(h.worker_id, h) for h in old]
        for h in dead:
            h.conn.close()
        self._ranks = ranked
        self._join(ranked)
        recovered = "old-layout"
        if dead:
            src = {
                h.worker_id: _holdings(self._param_specs, self._n_blocks, old_layout, r)
                for r, h in enumerate(ranked)
                if h not in replacements
            }
            dst = {
                h.worker_id: _holdings(self._param_specs, self._n_blocks, old_layout, r)
                for r, h in enumerate(ranked)
            }
            try:
                repair = build_plan(src, dst, {h.worker_id: h.slot.node for h in ranked})
            except PlanError:
                repair = None
            if repair is not None:
                group_rank = {h.worker_id: r for r, h in enumerate(ranked)}
                self._call(
                    [
                        (
                            h,
                            "switch_prepare",
                            {
                                "plan": repair,
                                "group_rank": group_rank,
                                "new_layout": old_layout,
                                "new_rank": r,
                                "step": self._step,
                            },
                        )
                        for r, h in enumerate(ranked)
                    ]
                )
                self._call([(h, "switch_commit", {}) for h in ranked])
                recovered = "replicas"
            elif self._snapshot:
                calls = []
                for r, h in enumerate(ranked):
                    sid = old[r].worker_id
                    snap, lay, rank, step = self._snapshot[sid]
                    calls.append(
                        (h, "restore", {"snap": snap, "layout": lay, "rank": rank, "step": step})
                    )
                self._call(calls)
                self._step = next(iter(self._snapshot.values()))[3]
                recovered = f"snapshot@step{self._step}"
            else:
                raise WorkerFailed(
                    f"{exc}; state of the dead workers is lost (no replica, no snapshot)"
                ) from exc
        self._layout = old_layout
        self._call([(h, "build_groups", {}) for h in ranked])
        self._refresh_live()
        report = self._report(
            old_layout,
            new_layout,
            plan,
            [],
            False,
            t_start,
            spawn_s,
            snapshot_s,
            plan_s,
            0.0,
            0.0,
            added,
            [],
            error=str(exc),
            recovered_from=recovered,
        )
        raise SwitchFailed(
            f"switch {old_layout} -> {new_layout} failed and was rolled back ({recovered}): {exc}",
            recovered,
        ) from _Report(report)


class _Report(Exception):
    """Carries the SwitchReport of a failed switch as the cause of SwitchFailed."""

    def __init__(self, report: SwitchReport) -> None:
        super().__init__("switch report")
        self.report = report
