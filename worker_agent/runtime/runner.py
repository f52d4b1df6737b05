"""The parent-side API: `JobRunner` starts a job's workers, trains, resizes (hot switch), stops.

One `JobRunner` per job, in the agent process. It composes a `WorkerPool` (processes and RPC)
and a `SwitchCoordinator` (the hot switch), and owns the background training driver.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from worker_agent.hotswitch.plan import PlanError, SwitchPlan, build_plan
from worker_agent.runtime.errors import JobCodeFailed, LayoutError, WorkerFailed
from worker_agent.runtime.export import read_export, write_export
from worker_agent.runtime.layout import ModelShape, choose_layout
from worker_agent.runtime.module_job import ModelInfo
from worker_agent.runtime.pool import Call, GpuSlot, PoolConfig, WorkerHandle, WorkerPool
from worker_agent.runtime.presets import JobSpec, build_job, is_module_job, model_shape
from worker_agent.runtime.remote import HostClient, interface_of
from worker_agent.runtime.switch import (
    RunState,
    SnapshotPolicy,
    SwitchCoordinator,
    SwitchMove,
    SwitchReport,
    SwitchTimings,
    Transport,
)
from worker_agent.runtime.worker import StepStats
from worker_agent.sharding import STATE_KINDS, Layout, shard_map

__all__ = ["Checkpoint", "GpuSlot", "JobRunner", "Progress", "RecoveryReport", "SwitchReport"]


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


@dataclass(frozen=True)
class RecoveryReport:
    """What `recover` found lost and where the job's state came from."""

    src: Layout
    dst: Layout
    lost_pids: list[int]
    lost_nodes: list[str]
    """Nodes that lost at least one of the job's workers."""
    recovered_from: str
    """`replicas` (the survivors held every shard) or `checkpoint@step<N>`."""
    step_reached: int
    """The step the job had reached when its workers were lost."""
    step: int
    """The step training resumes at (`step_reached` minus the steps lost)."""
    bytes_moved: int
    bytes_cross_node: int
    recover_s: float

    @property
    def steps_lost(self) -> int:
        """Steps to be trained again."""
        return self.step_reached - self.step


class JobRunner:
    """Runs one job on a pool of worker processes and hot-switches its layout on resize."""

    def __init__(
        self,
        snapshot_policy: SnapshotPolicy = "auto",
        timeout_s: float = 60.0,
        backend: str | None = None,
        store_host: str = "127.0.0.1",
        direct_min_run_bytes: int | None = None,
        snapshot_every_steps: int = 50,
        transport: Transport = "auto",
        stage_nice: int | None = None,
        hosts: Mapping[str, HostClient] | None = None,
        log_dir: str | Path | None = None,
        remote_ready: bool = False,
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

        `hosts`: the worker hosts of other nodes by node name (a job across nodes): slots on
        those nodes get their workers there, which dial back to `store_host` (then an address
        they reach, not loopback) with the job's grant on their node (`HostClient.authkey`). Every worker's state is then kept as a copy
        (the `periodic` policy of GPUs), since no node can map another's memory.

        `remote_ready`: the job may grow onto other nodes later (hosts are added to `self.hosts`
        before the resize that uses them): set up as with hosts from the start (the dialler
        listens on `store_host`, no shared-memory state), so that growth is a hot switch.
        """
        self.stage_nice = stage_nice
        self.snapshot_policy = snapshot_policy
        self.direct_min_run_bytes = direct_min_run_bytes
        self.snapshot_every_steps = snapshot_every_steps
        self.transport = transport
        self.timeout_s = timeout_s
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        # GPU memory dies with its process, so only CPU state can be shared with the runner.
        self.hosts = dict(hosts or {})
        self.log_dir = None if log_dir is None else str(log_dir)
        """Local workers' stdout/stderr and scalars go to files here (`worker-<id>.log`)."""
        self._shared_state = (
            self.backend != "nccl"
            and snapshot_policy in ("auto", "before_switch")
            and not self.hosts
            and not remote_ready
        )
        self.remote_ready = remote_ready or bool(self.hosts)
        self.store_host = store_host
        self._run = RunState()
        self._pool: WorkerPool | None = None
        self._switch: SwitchCoordinator | None = None
        self._spec: JobSpec | None = None
        self._shape: ModelShape | None = None
        self.model_info: ModelInfo | None = None
        """Module jobs: the model's geometry as its first worker described it."""
        self._step_at = 0.0
        self._loss: float | None = None
        self._samples_per_s = 0.0
        self._lock = threading.RLock()
        self._switch_waiting = threading.Event()
        self._lock_wanted = threading.Event()
        """Set while resize() waits for the lock between two chunks (the lock is not fair)."""
        self._stop = threading.Event()
        self._driver: threading.Thread | None = None
        self._driver_error: BaseException | None = None

    # ----- public API -----------------------------------------------------------------------
    def start(
        self,
        job_spec: JobSpec,
        gpus: Sequence[GpuSlot] | int,
        layout: Layout | None = None,
        memory_per_gpu_bytes: float | None = None,
        gpus_per_node: int | None = None,
        checkpoint: Checkpoint | None = None,
        state: tuple[dict[str, torch.Tensor], int] | None = None,
        init_from: str | Path | None = None,
        model_info: ModelInfo | None = None,
        init_weights_only: bool = False,
    ) -> Layout:
        """Start one worker per GPU slot in `layout` (or the chosen one).

        State is fresh, or read from `checkpoint` files, or taken from `state` = (the full
        logical tensors as `gather_state()` returns them, the optimizer step they belong to),
        or (module jobs) loaded from an `export()`ed directory `init_from` (the model's
        `model.safetensors`; with `optimizer.safetensors` too, training resumes at its step;
        `init_weights_only`: the weights only, from step 0 with a fresh optimizer). `init_from`
        may also be a safetensors state dict file with the model's names.
        `memory_per_gpu_bytes`: None = the device's memory on GPUs, 64 GiB for CPU slots.
        `model_info`: a module job's geometry from an earlier run of the same job (its
        `model_info`): with `checkpoint`, `state` or `init_from` the model then need not be
        built and initialised once more (a restart).
        """
        if self._run.ranks:
            raise RuntimeError("job already started; use resize() or stop()")
        slots = self._slots(gpus)
        self._spec = job_spec
        self._memory_per_gpu_bytes = memory_per_gpu_bytes or self._device_memory(slots)
        self._gpus_per_node = gpus_per_node
        pool = WorkerPool(
            PoolConfig(
                spec_json=job_spec.model_dump_json(),
                backend=self.backend,
                store_host=self.store_host,
                timeout_s=self.timeout_s,
                direct_min_run_bytes=self.direct_min_run_bytes,
                shared_state=self._shared_state,
                stage_nice=self.stage_nice,
                hosts=self.hosts,
                socket_ifname=interface_of(self.store_host) if self.remote_ready else None,
                remote_ready=self.remote_ready,
                log_dir=self.log_dir,
            )
        )
        self._pool = pool
        self._run = RunState()
        handles: list[WorkerHandle] = []
        try:
            if is_module_job(job_spec):
                init: dict[str, torch.Tensor] = {}
                if model_info is not None and (checkpoint or state or init_from):
                    info = model_info
                    pool.setup = {"info": info}
                    handles = pool.spawn(slots)
                else:
                    # The agent never imports user code: the first worker builds the model once.
                    handles = pool.spawn(slots[:1])
                    info, init = pool.call_all(handles, "describe")[0]
                    pool.setup = {"info": info}
                    handles += pool.spawn(slots[1:])
                self.model_info = info
                param_specs, n_blocks, kinds = info.specs, info.n_blocks, info.state_kinds
                self._shape = info.shape
                if init_from is not None:
                    state = read_export(Path(init_from), info, weights_only=init_weights_only)
                elif state is None and checkpoint is None:
                    state = (init, 0)
            else:
                job = build_job(job_spec)
                param_specs, n_blocks, kinds = job.param_specs(), job.n_blocks(), STATE_KINDS
                self._shape = model_shape(job, job_spec)
            layout = layout or self._choose(len(slots))
            if layout.world_size != len(slots):
                raise LayoutError(
                    f"layout {layout} needs {layout.world_size} GPUs, got {len(slots)}"
                )
            if not handles:
                handles = pool.spawn(slots)
        except BaseException:
            pool.close(handles)
            self._pool = None
            raise
        self._switch = SwitchCoordinator(
            pool,
            self._run,
            param_specs,
            n_blocks,
            self.snapshot_policy,
            self._shared_state,
            self.transport,
            self.snapshot_every_steps,
            kinds,
        )
        self._run.ranks = handles
        pool.join(handles)
        self._run.layout = layout
        self._run.step = 0
        if state is not None:
            tensors, step = state
            calls: list[Call] = []
            for r, h in enumerate(handles):
                smap = shard_map(param_specs, n_blocks, layout, r, kinds)
                flat = torch.zeros(smap.n_state_elems)
                for hold in smap.holdings():
                    src = tensors.get(hold.tensor)
                    if src is None and hold.tensor.startswith(("param/", "buffer/")):
                        raise LayoutError(f"state has no {hold.tensor}")
                    if src is not None:  # optimizer state absent: a fresh optimizer (zeros)
                        flat[hold.offset : hold.offset + hold.numel].copy_(
                            src[hold.start : hold.end]
                        )
                calls.append(
                    (h, "restore", {"snap": flat, "layout": layout, "rank": r, "step": step})
                )
            pool.call(calls)
            self._run.step = step
        elif checkpoint is None:
            pool.call(
                [(h, "init_state", {"layout": layout, "rank": r}) for r, h in enumerate(handles)]
            )
        else:
            # Resharding on load: the planner maps checkpoint files (ids -1, -2, ...) to ranks.
            sw = self._switch
            ckpt_holdings = {
                -1 - k: sw.holdings(checkpoint.layout, k)
                for k in range(checkpoint.layout.world_size)
            }
            new_holdings = {h.worker_id: sw.holdings(layout, r) for r, h in enumerate(handles)}
            plan = build_plan(ckpt_holdings, new_holdings)
            files = {-1 - k: f for k, f in enumerate(checkpoint.files)}
            pool.call(
                [
                    (
                        h,
                        "load_checkpoint",
                        {"layout": layout, "rank": r, "plan": plan, "files": files},
                    )
                    for r, h in enumerate(handles)
                ]
            )
            self._run.step = checkpoint.step
        self._switch.refresh_live()
        return layout

    def export(self, directory: str | Path) -> Path:
        """Write the job in standard formats (module jobs): `model.safetensors` (the model's full
        state dict: plain `load_state_dict`, or `from_pretrained` of the directory for Hugging
        Face models, whose `config.json` is written too), `optimizer.safetensors` (optimizer
        state per parameter, module-shaped) and `greenflow.json` (step, optimizer, layout)."""
        if self.model_info is None:
            raise RuntimeError("export() needs a module job (a built-in model or job module)")
        state = self.gather_state()
        return write_export(Path(directory), self.model_info, state, self._run.step, self.layout)

    def save_checkpoint(self, directory: str) -> Checkpoint:
        """Every worker writes its shard to `directory` (the restart baseline; not used by resize)."""
        files = [f"{directory}/rank{r}.pt" for r in range(len(self._run.ranks))]
        with self._lock:
            self._pool_().call(
                [
                    (h, "save_checkpoint", {"path": f})
                    for h, f in zip(self._run.ranks, files, strict=True)
                ]
            )
        return Checkpoint(self.layout, self._run.step, files)

    def probe_p2p(
        self, pairs: list[tuple[int, int, int]], repeats: int = 3, fresh: bool = False
    ) -> float:
        """Median seconds of a plain batched p2p copy of (src_rank, dst_rank, bytes)."""
        elems = [(s, d, n // 4) for s, d, n in pairs]
        with self._lock:
            times = self._pool_().call_all(
                self._run.ranks, "p2p_probe", pairs=elems, repeats=repeats, fresh=fresh
            )
        return float(max(times))

    def probe_shm_copy(self, pairs: list[tuple[int, int, int]], repeats: int = 3) -> float:
        """Median seconds of a plain shared-memory copy of (src_rank, dst_rank, bytes): each
        receiver copies its pairs out of buffers its senders allocated, all receivers at once."""
        elems = [(s, d, n // 4) for s, d, n in pairs]
        pool = self._pool_()
        with self._lock:
            bufs = pool.call_all(self._run.ranks, "shm_probe_buffers", pairs=elems)
            it = {r: iter(b) for r, b in enumerate(bufs)}
            sources = [next(it[s]) for s, _, _ in elems]
            times = pool.call(
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
                    for r, h in enumerate(self._run.ranks)
                ]
            )
        return float(max(times))

    @property
    def layout(self) -> Layout:
        """The current layout."""
        if self._run.layout is None:
            raise RuntimeError("job not started")
        return self._run.layout

    def worker_pids(self) -> list[int]:
        """Worker process ids by rank."""
        return [h.pid for h in self._run.ranks]

    def lost_nodes(self) -> list[str]:
        """Nodes on which a worker of the current layout is no longer alive (its node or its
        link is gone, or the process died)."""
        return sorted({h.slot.node for h in self._run.ranks if not h.proc.is_alive()})

    def worker_ids(self) -> list[int]:
        """Worker ids (the `worker-<id>.log` names) by rank."""
        return [h.worker_id for h in self._run.ranks]

    def slots(self) -> list[GpuSlot]:
        """GPU slots by rank."""
        return [h.slot for h in self._run.ranks]

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
                    if max_steps is not None and self._run.step >= max_steps:
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
                            n = min(n, max_steps - self._run.step)
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
            raise _driver_failure(err) from err

    def step_progress(self) -> Progress:
        """Current step, samples/s of the last chunk, last loss, layout and worker pids."""
        if self._driver_error is not None:
            raise _driver_failure(self._driver_error)
        return Progress(
            self._run.step,
            self._samples_per_s,
            self._loss,
            self.layout,
            self.worker_pids(),
            self._step_at,
        )

    def resize(
        self,
        new_gpus: Sequence[GpuSlot] | int,
        layout: Layout | None = None,
        gpus_per_node: int | None = None,
    ) -> SwitchReport:
        """Hot-switch to `new_gpus` (kept slots keep their worker process) and a new layout.

        `gpus_per_node`: TP groups of the chosen layout stay within this many consecutive
        slots (None: as at start); for a job across nodes, the slots of each node."""
        pool, sw = self._pool_(), self._switch_()
        if gpus_per_node is not None:
            self._gpus_per_node = gpus_per_node
        slots = self._slots(new_gpus)
        old_layout = self.layout
        new_layout = layout or self._choose(len(slots))
        if new_layout.world_size != len(slots):
            raise LayoutError(
                f"layout {new_layout} needs {new_layout.world_size} GPUs, got {len(slots)}"
            )
        current = {h.slot: h for h in self._run.ranks}
        keep = [current[s] for s in slots if s in current]
        leaving = [h for h in self._run.ranks if h.slot not in slots]
        old = list(self._run.ranks)
        timings = SwitchTimings()
        t0 = time.perf_counter()
        # Everything up to the pause overlaps training: new workers boot (import torch, connect
        # to the store), the runner plans, every worker stages (allocates and pre-faults).
        added = pool.spawn([s for s in slots if s not in current])
        timings.spawn_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        target = sw.assign_ranks(old_layout, new_layout, keep, added)
        plan = sw.plan(old_layout, new_layout, old, target, added)
        timings.plan_s = time.perf_counter() - t0
        move = SwitchMove(old_layout, new_layout, old, target, leaving, added, plan)
        t0 = time.perf_counter()
        sw.stage(move, self._between_chunks)
        timings.stage_s = time.perf_counter() - t0
        self._switch_waiting.set()
        try:
            with self._lock:
                report = sw.execute(move, timings)
        finally:
            self._switch_waiting.clear()
        if self._driver is None or not self._driver.is_alive():
            # Not training: free the replaced state now rather than at the next command (a
            # training driver's next chunk frees it in a thread instead).
            with self._lock:
                pool.call_all(self._run.ranks, "free_retired")
        return report

    def recover(
        self,
        new_gpus: Sequence[GpuSlot] | int,
        layout: Layout | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> RecoveryReport:
        """Continue after workers were lost outside a switch (a node died): on `new_gpus`.

        The survivors' shards are redistributed onto `new_gpus` (kept slots keep their worker)
        when together they still hold the whole state (data-parallel replicas); otherwise
        every worker restarts from `checkpoint`, and the steps since it are lost. WorkerFailed
        when neither is possible. The failed chunk never counts: a lost peer fails the
        gradient all-reduce before any optimizer step, so survivors hold the last full step.
        """
        with contextlib.suppress(WorkerFailed):
            self.pause()
        t0 = time.perf_counter()
        pool, sw, run = self._pool_(), self._switch_(), self._run
        old_layout, old = self.layout, list(run.ranks)
        dead = [h for h in old if not h.proc.is_alive()]
        for h in dead:
            pool.kill(h)
        survivors = [(r, h) for r, h in enumerate(old) if h not in dead]
        slots = self._slots(new_gpus)
        new_layout = layout or self._choose(len(slots))
        if new_layout.world_size != len(slots):
            raise LayoutError(
                f"layout {new_layout} needs {new_layout.world_size} GPUs, got {len(slots)}"
            )
        lost_pids = [h.pid for h in dead]
        lost_nodes = sorted({h.slot.node for h in dead})
        reached = run.step
        src = {h.worker_id: sw.holdings(old_layout, r) for r, h in survivors}
        try:
            # Whether the survivors still hold every element (ids that no worker uses).
            build_plan(src, {-1 - r: sw.holdings(new_layout, r) for r in range(len(slots))})
        except PlanError as exc:
            if checkpoint is None:
                raise WorkerFailed(
                    f"workers on {lost_nodes} lost; their state has no replica and no "
                    f"checkpoint was given: {exc}"
                ) from exc
            spec, info = self._spec, self.model_info
            assert spec is not None
            run.ranks = [h for _, h in survivors]
            self.stop()
            self.start(
                spec,
                slots,
                new_layout,
                self._memory_per_gpu_bytes,
                self._gpus_per_node,
                checkpoint=checkpoint,
                model_info=info,
            )
            return RecoveryReport(
                old_layout, new_layout, lost_pids, lost_nodes, f"checkpoint@step{checkpoint.step}",
                reached, checkpoint.step, 0, 0, time.perf_counter() - t0,
            )  # fmt: skip
        current = {h.slot: h for _, h in survivors}
        keep = [current[s] for s in slots if s in current]
        leaving = [h for _, h in survivors if h.slot not in slots]
        added = pool.spawn([s for s in slots if s not in current])
        target = sw.assign_ranks(old_layout, new_layout, keep, added)
        union = [*(h for _, h in survivors), *added]
        plan = build_plan(
            src,
            {h.worker_id: sw.holdings(new_layout, r) for r, h in enumerate(target)},
            {h.worker_id: h.slot.node for h in union},
        )
        self._redistribute(plan, union, target, new_layout)
        for h in leaving:
            pool.release(h)
        run.ranks, run.layout = target, new_layout
        sw.snapshot, sw.snapshot_step = {}, None
        sw.refresh_live()
        return RecoveryReport(
            old_layout, new_layout, lost_pids, lost_nodes, "replicas", reached, run.step,
            plan.bytes_moved, plan.bytes_cross_node, time.perf_counter() - t0,
        )  # fmt: skip

    def _redistribute(
        self,
        plan: SwitchPlan,
        union: list[WorkerHandle],
        target: list[WorkerHandle],
        layout: Layout,
    ) -> None:
        """Run `plan` among `union` (a fresh group), then group `target` in `layout`."""
        pool = self._pool_()
        pool.join(union)
        group_rank = {h.worker_id: i for i, h in enumerate(union)}
        new_rank = {h.worker_id: r for r, h in enumerate(target)}
        pool.call(
            [
                (
                    h,
                    "switch_prepare",
                    {
                        "plan": plan,
                        "group_rank": group_rank,
                        "new_layout": layout if h.worker_id in new_rank else None,
                        "new_rank": new_rank.get(h.worker_id, -1),
                        "step": self._run.step,
                    },
                )
                for h in union
            ]
        )
        pool.call_all(union, "switch_commit")
        if [h.worker_id for h in union] != [h.worker_id for h in target]:
            pool.join(target)
        pool.call_all(target, "build_groups")

    def gather_state(self) -> dict[str, torch.Tensor]:
        """Full logical tensors (`param/…`, `exp_avg/…`, `exp_avg_sq/…`) assembled from shards.

        Raises WorkerFailed if two replicas of the same elements differ bitwise.
        """
        with self._lock:
            parts = self._pool_().call_all(self._run.ranks, "shards")
        sizes = {p.name: p.numel for p in self._switch_().param_specs}
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
        self._pool_().call([(self._run.ranks[rank], "arm_fault", {"mode": mode})])

    def stop(self) -> None:
        """Stop training and release every worker."""
        with contextlib.suppress(WorkerFailed):
            self.pause()
        if self._pool is not None:
            self._pool.close(self._run.ranks)
        self._run.ranks = []
        self._run.layout = None
        if self._switch is not None:
            self._switch.forget()
        self._pool = None

    def __enter__(self) -> JobRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- internals ------------------------------------------------------------------------
    def _pool_(self) -> WorkerPool:
        if self._pool is None:
            raise RuntimeError("job not started")
        return self._pool

    def _switch_(self) -> SwitchCoordinator:
        if self._switch is None:
            raise RuntimeError("job not started")
        return self._switch

    @contextlib.contextmanager
    def _between_chunks(self) -> Iterator[None]:
        """Hold the runner lock between two training chunks of the background driver.

        Without the flag the driver thread took the lock back for its next chunk, again and
        again: staging started 1-5 chunks late (measured: 8.6 s at 100 M).
        """
        self._lock_wanted.set()
        try:
            with self._lock:
                self._lock_wanted.clear()
                yield
        finally:
            self._lock_wanted.clear()

    def _choose(self, gpus: int) -> Layout:
        assert self._shape is not None
        return choose_layout(self._shape, gpus, self._memory_per_gpu_bytes, self._gpus_per_node)

    def _device_memory(self, slots: list[GpuSlot]) -> float:
        """Memory of the smallest device the job runs on (64 GiB for simulated CPU slots)."""
        if self.backend != "nccl":
            return 64 * 2**30
        return float(min(torch.cuda.get_device_properties(s.index).total_memory for s in slots))

    @staticmethod
    def _slots(gpus: Sequence[GpuSlot] | int) -> list[GpuSlot]:
        slots = [GpuSlot("local", i) for i in range(gpus)] if isinstance(gpus, int) else list(gpus)
        if not slots or len(set(slots)) != len(slots):
            raise LayoutError(f"need a non-empty list of distinct GPU slots, got {gpus!r}")
        return slots

    def _train(self, steps: int) -> list[tuple[int, float]]:
        assert self._spec is not None
        t0 = time.perf_counter()
        per_worker: list[list[StepStats]] = self._pool_().call_all(
            self._run.ranks, "train", steps=steps
        )
        wall_s = time.perf_counter() - t0
        out: list[tuple[int, float]] = []
        for i in range(steps):
            parts = [w[i].loss_part for w in per_worker]
            out.append((per_worker[0][i].step, float(sum(p for p in parts if p is not None))))
        self._run.step += steps
        self._step_at = time.perf_counter()
        self._loss = out[-1][1] if out else self._loss
        self._samples_per_s = self._spec.global_batch_size * steps / wall_s if wall_s > 0 else 0.0
        self._switch_().after_chunk()
        return out


def _driver_failure(err: BaseException) -> WorkerFailed:
    """The background driver's error as the caller sees it (the job's own code's stays so)."""
    kind = JobCodeFailed if isinstance(err, JobCodeFailed) else WorkerFailed
    return kind(f"training driver failed: {err}")
