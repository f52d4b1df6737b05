"""One worker process: holds one shard of the job's state, trains, and takes part in switches.

The parent (`JobRunner`) drives workers with commands over a pipe; every command is answered
with `("ok", result)` or `("error", message)`. Process groups are rebuilt per generation from a
TCPStore that the parent hosts, so the workers that stay keep their process and their memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from worker_agent import joblog
from worker_agent.hotswitch.execute import (
    ExecStats,
    StagedSwitch,
    StagingBuffers,
    run_switch,
    stage_switch,
)
from worker_agent.hotswitch.plan import SwitchPlan
from worker_agent.runtime.errors import JobSpecError
from worker_agent.runtime.job import TensorParallel, TrainingJob
from worker_agent.runtime.optim import adamw_step
from worker_agent.runtime.presets import JobSpec, build_job, is_module_job
from worker_agent.sharding import STATE_KINDS, Layout, ParamSpec, ShardMap, shard_map, split_blocks


class Channel(Protocol):
    """The worker's link to its runner: a pipe, or a socket when the runner is on another node."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs at start."""

    worker_id: int
    spec_json: str
    store_host: str
    store_port: int
    backend: str
    device_index: int | None
    """CUDA device for NCCL; None for CPU workers."""
    timeout_s: float = 60.0
    direct_min_run_bytes: int | None = None
    """Switch messages: runs at least this large go unpacked (None: the executor's default)."""
    fail_at: str | None = None
    """Test hook, next switch: `"switch"` exits abruptly in the pause, `"transfer"` raises,
    `"stage"` exits abruptly while staging (before the pause), `"commit"` exits abruptly when
    told to commit, `"regroup"` exits abruptly when told to rebuild its groups after committing
    (`join` of the new generation or `build_groups`)."""
    stage_nice: int | None = None
    """Nice value of the staging thread on CPU (None: the training thread's)."""
    shared_state: bool = False
    """Keep the flat state buffer in shared memory that the runner maps too (CPU only), so a
    worker's state outlives its process without a snapshot copy."""
    socket_ifname: str | None = None
    """Network interface gloo/NCCL bind to (the one other nodes reach); None: their default,
    which inside one node is fine and across nodes may pick an address peers cannot reach."""
    log_path: str | None = None
    """Append the process's stdout and stderr (file descriptors 1 and 2, so native output and
    crashes too) to this file, and the job's `greenflow_log` scalars to `<log_path>.scalars`."""


@dataclass
class StepStats:
    """One training step as one worker saw it."""

    step: int
    loss_part: float | None
    """This worker's share of the global loss (last stage, TP rank 0 only), else None."""
    compute_s: float


class Worker:
    """State and behaviour of one worker process."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.spec = JobSpec.model_validate_json(cfg.spec_json)
        self.kinds: tuple[str, ...] = STATE_KINDS
        """Flat-buffer sections: the parameters, then the optimizer's state tensors."""
        self.specs: list[ParamSpec] = []
        self.n_blocks = 0
        self._load_job()
        if cfg.device_index is not None:
            torch.cuda.set_device(cfg.device_index)
            self.device = torch.device("cuda", cfg.device_index)
        else:
            self.device = torch.device("cpu")
        self.store = dist.TCPStore(
            cfg.store_host,
            cfg.store_port,
            is_master=False,
            timeout=timedelta(seconds=cfg.timeout_s),
        )
        self.buffers = StagingBuffers(self.device)
        self.layout: Layout | None = None
        self.rank = -1
        self.smap: ShardMap | None = None
        self.flat: torch.Tensor | None = None
        self.params: dict[str, torch.Tensor] = {}
        self.grad_flat: torch.Tensor | None = None
        self.step = 0
        self.tp = TensorParallel()
        self.dp_group: dist.ProcessGroup | None = None
        self._snap: torch.Tensor | None = None
        self._pending: (
            tuple[Layout | None, int, torch.Tensor | None, int, dict[str, Any]] | None
        ) = None
        self._retired: list[Any] = []
        self._staging: _Staging | None = None
        self._peer_maps: list[torch.Tensor] = []
        """Peers' state buffers mapped for the last switch's pulls (unmapped after the pause)."""
        self._old_groups: list[dist.ProcessGroup] = []
        """Sub-groups a switch replaced; destroyed after the pause (each holds open sockets)."""
        self.stage: Any = None
        """The module job's stage model (None for the built-in functional presets)."""
        self.optimizer: Any = None
        self._undo: dict[str, Any] | None = None
        """The state a commit replaced, until the switch is final (the next command that is not
        part of the pause): `switch_abort` puts it back if the switch fails after the commit."""

    def _load_job(self) -> None:
        """The job's parameter geometry (built-in functional presets)."""
        self.job: TrainingJob = build_job(self.spec)
        self.specs = self.job.param_specs()
        self.n_blocks = self.job.n_blocks()

    def _smap(self, layout: Layout, rank: int) -> ShardMap:
        return shard_map(self.specs, self.n_blocks, layout, rank, self.kinds)

    def _adopt(self, layout: Layout, rank: int, flat: torch.Tensor, prebuilt: Any) -> None:
        """Bind the job's compute to a newly installed state buffer (`prebuilt` from staging)."""

    def _prepare(self, staged: StagedSwitch, new_layout: Layout, new_rank: int) -> None:
        """Build what the new layout needs before the pause (staging thread)."""

    # ----- process groups -------------------------------------------------------------------
    def cmd_join(self, generation: int, rank: int, world_size: int) -> None:
        """Leave the current process group (if any) and join generation `generation`."""
        self._fail_if_committed()
        if dist.is_initialized():
            dist.destroy_process_group()
        # destroy_process_group() destroyed every sub-group too; destroying one again raises.
        self._old_groups = []
        self.tp = TensorParallel()
        self.dp_group = None
        store = dist.PrefixStore(f"gen{generation}", self.store)
        try:
            dist.init_process_group(
                self.cfg.backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=self.cfg.timeout_s),
                device_id=self.device if self.device.type == "cuda" else None,
            )
        except Exception:
            # A failed init (a peer died) leaves torch's group counter advanced, so this worker
            # would name its next generation's groups differently from a fresh replacement and
            # the rollback's rendezvous would hang; reset it as destroy_process_group() does.
            dist.distributed_c10d._world.group_count = 0
            raise
        dist.barrier()

    def _build_groups(self) -> None:
        """Sub-groups of the current layout, created in the same order on every rank."""
        assert self.layout is not None
        self.tp, self.dp_group = self._make_groups(self.layout, self.rank)

    def _make_groups(self, lay: Layout, me: int) -> tuple[TensorParallel, dist.ProcessGroup | None]:
        tp = TensorParallel(size=lay.tp, rank=lay.coords(me).tp)
        dp_group = None
        # new_group's own default is 30 min, not the default group's: a peer dying while the
        # groups form (or in a TP/DP collective) would hang the others for half an hour and
        # answer the runner long after it gave up on them.
        timeout = timedelta(seconds=self.cfg.timeout_s)
        if lay.tp > 1:
            for ranks in lay.tp_groups():
                g = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    tp.group = g
        if lay.dp > 1:
            for ranks in lay.dp_groups():
                g = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    dp_group = g
        return tp, dp_group

    # ----- state ----------------------------------------------------------------------------
    def _alloc_state(self, numel: int) -> torch.Tensor:
        """An uninitialised flat state buffer; in shared memory when the runner keeps a handle."""
        if self.cfg.shared_state and self.device.type == "cpu":
            storage = torch.UntypedStorage._new_shared(numel * 4)
            return torch.empty(0).set_(storage)
        return torch.empty(numel, device=self.device)

    def cmd_state_handle(self) -> tuple[torch.Tensor, Layout, int] | None:
        """The shared-memory state buffer (sent as a handle, not copied), or None."""
        if not self.cfg.shared_state or self.flat is None or not self.flat.is_shared():
            return None
        assert self.layout is not None
        return self.flat, self.layout, self.rank

    def _install(
        self, layout: Layout, rank: int, flat: torch.Tensor, step: int, prebuilt: Any = None
    ) -> None:
        """Adopt a flat state buffer for (layout, rank): parameters become views into it."""
        self.layout, self.rank, self.step = layout, rank, step
        self.smap = self._smap(layout, rank)
        self.flat = flat
        # The gradient buffer is allocated by the first step (not inside the switch).
        self.grad_flat = None
        self.params = {}
        for ps in self.smap.params:
            view = flat[ps.offset : ps.offset + ps.end - ps.start].view(ps.local_shape)
            # detach() shares storage: the optimizer's in-place updates of `flat` are the params.
            self.params[ps.spec.name] = view.detach().requires_grad_(True)
        self._adopt(layout, rank, flat, prebuilt)

    def cmd_init_state(self, layout: Layout, rank: int) -> int:
        """Fresh state from the job's seeded initialisation; returns its size in bytes."""
        smap = self._smap(layout, rank)
        flat = self._alloc_state(smap.n_state_elems).zero_()
        for ps in smap.params:
            full = ps.spec.init_full(self.spec.seed).reshape(-1)[ps.start : ps.end]
            flat[ps.offset : ps.offset + full.numel()].copy_(full)
        self._install(layout, rank, flat, 0)
        self._build_groups()
        return flat.numel() * flat.element_size()

    def cmd_snapshot(self) -> tuple[torch.Tensor, Layout, int, int]:
        """A copy of the state in shared memory; it outlives this process if the parent keeps it."""
        assert self.flat is not None and self.layout is not None
        # Reuse the shared-memory block of the previous snapshot when the size matches: refilling
        # warm pages is several times faster than faulting in fresh ones.
        if self._snap is None or self._snap.numel() != self.flat.numel():
            self._snap = torch.empty(self.flat.numel()).share_memory_()
        self._snap.copy_(self.flat)
        return self._snap, self.layout, self.rank, self.step

    def cmd_restore(self, snap: torch.Tensor, layout: Layout, rank: int, step: int) -> None:
        """Load a snapshot (layout, rank must match the current process group)."""
        flat = self._alloc_state(snap.numel())
        flat.copy_(snap)
        self._install(layout, rank, flat, step)
        self._build_groups()

    def cmd_shards(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        """Every local shard (params and Adam moments) with its logical range, for checks."""
        assert self.smap is not None and self.flat is not None
        out: dict[str, tuple[int, int, torch.Tensor]] = {}
        for h in self.smap.holdings():
            out[h.tensor] = (h.start, h.end, self.flat[h.offset : h.offset + h.numel].cpu().clone())
        return out

    def cmd_info(self) -> dict[str, Any]:
        """Pid, layout, rank, step and state bytes of this worker."""
        return {
            "pid": os.getpid(),
            "layout": self.layout,
            "rank": self.rank,
            "step": self.step,
            "state_bytes": 0 if self.flat is None else self.flat.numel() * 4,
        }

    # ----- training -------------------------------------------------------------------------
    def free_retired(self, background: bool) -> None:
        """Drop the state buffers a switch replaced (unmapping takes tens of ms)."""
        retired, self._retired = self._retired, []
        groups, self._old_groups = self._old_groups, []
        # The switch is final: the replaced state will not be needed back.
        self._undo = None
        for g in groups:
            # Without this every switch between the same workers leaked a few file descriptors.
            dist.destroy_process_group(g)
        if background:
            threading.Thread(target=retired.clear, name="greenflow-free", daemon=True).start()
        else:
            retired.clear()

    def cmd_free_retired(self) -> None:
        """Free the state buffers the last switch replaced, now (the loop already did)."""

    def cmd_train(self, steps: int) -> list[StepStats]:
        """Run `steps` optimizer steps in the current layout."""
        return [self._train_step() for _ in range(steps)]

    def _train_step(self) -> StepStats:
        assert self.layout is not None and self.flat is not None
        t0 = time.perf_counter()
        lay, c = self.layout, self.layout.coords(self.rank)
        gbs, mbs = self.spec.global_batch_size, self.spec.micro_batch_size
        per_dp = gbs // lay.dp
        batch = self.job.batch(self.step, gbs)
        batch = {
            k: v[c.dp * per_dp : (c.dp + 1) * per_dp].to(self.device) for k, v in batch.items()
        }
        micro = [
            {k: v[m * mbs : (m + 1) * mbs] for k, v in batch.items()} for m in range(per_dp // mbs)
        ]
        blocks = split_blocks(self.n_blocks, lay.pp)[c.pp]
        for p in self.params.values():
            p.grad = None
        if lay.pp == 1:
            loss_sum = 0.0
            for mb in micro:
                h = self.job.embed(self.params, mb)
                for i in blocks:
                    h = self.job.block(i, self.params, h, self.tp)
                loss = self.job.head_loss(self.params, h, mb) / gbs
                loss.backward()
                loss_sum += float(loss.detach())
            loss_part: float | None = loss_sum if c.tp == 0 else None
        else:
            loss_part = self._gpipe(micro, blocks, c.pp, gbs)
            if c.tp != 0:
                loss_part = None
        self._optimizer_step()
        self.step += 1
        return StepStats(self.step - 1, loss_part, time.perf_counter() - t0)

    def _gpipe(
        self, micro: list[dict[str, torch.Tensor]], blocks: range, stage: int, gbs: int
    ) -> float | None:
        """GPipe: all forwards, then all backwards, activations sent with p2p between stages.

        Hand-written rather than torch.distributed.pipelining: that API owns the model split
        and the stage modules, while here stages are rebuilt from flat shards at every switch.
        """
        assert self.layout is not None
        lay = self.layout
        stride = lay.dp * lay.tp
        prev_rank, next_rank = self.rank - stride, self.rank + stride
        first, last = stage == 0, stage == lay.pp - 1
        saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        pending: list[Any] = []
        keep: list[torch.Tensor] = []
        for mb in micro:
            h_in: torch.Tensor | None = None
            if first:
                h = self.job.embed(self.params, mb)
            else:
                header = torch.zeros(8, dtype=torch.int64, device=self.device)
                dist.recv(header, prev_rank)
                shape = tuple(int(x) for x in header[1 : 1 + int(header[0])])
                h_in = torch.empty(shape, device=self.device)
                dist.recv(h_in, prev_rank)
                h_in.requires_grad_(True)
                h = h_in
            for i in blocks:
                h = self.job.block(i, self.params, h, self.tp)
            if last:
                out = self.job.head_loss(self.params, h, mb) / gbs
            else:
                out = h
                header = torch.zeros(8, dtype=torch.int64, device=self.device)
                header[0] = h.dim()
                header[1 : 1 + h.dim()] = torch.tensor(h.shape)
                act = h.detach().contiguous()
                keep += [header, act]
                pending.append(dist.isend(header, next_rank))
                pending.append(dist.isend(act, next_rank))
            saved.append((h_in, out))
        loss_sum = 0.0
        for h_in, out in saved:
            if last:
                out.backward()
                loss_sum += float(out.detach())
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, next_rank)
                torch.autograd.backward(out, grad)
            if h_in is not None:
                assert h_in.grad is not None
                g = h_in.grad.contiguous()
                keep.append(g)
                pending.append(dist.isend(g, prev_rank))
        for w in pending:
            w.wait()
        return loss_sum if last else None

    def _optimizer_step(self) -> None:
        """Sum gradients over DP (the loss is already divided by the global batch), then AdamW."""
        assert self.smap is not None and self.flat is not None
        if self.grad_flat is None:
            self.grad_flat = torch.empty(self.smap.n_param_elems, device=self.device)
        g = self.grad_flat
        for ps in self.smap.params:
            p = self.params[ps.spec.name]
            n = ps.end - ps.start
            if p.grad is None:
                g[ps.offset : ps.offset + n].zero_()
            else:
                g[ps.offset : ps.offset + n].copy_(p.grad.reshape(-1))
        if self.dp_group is not None:
            dist.all_reduce(g, group=self.dp_group)
        adamw_step(self.flat, g, self.step + 1, self.spec.optimizer)

    # ----- hot switch -----------------------------------------------------------------------
    def cmd_switch_stage(
        self,
        switch_id: int,
        plan: SwitchPlan,
        new_layout: Layout | None,
        new_rank: int,
        done_key: str,
        prebuild_groups: bool = False,
        peer_flats: dict[int, torch.Tensor] | None = None,
        pull_pairs: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        """Start staging a switch in a thread (training goes on); sets `done_key` when done.

        `pull_pairs` (sender, receiver) move no message: the receiver copies out of the
        sender's shared-memory state buffer, which `peer_flats` maps here (see execute.py).
        """
        if self.cfg.fail_at == "stage":
            os._exit(17)
        self.cmd_switch_abort()
        staging = _Staging(switch_id)

        def work() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                groups = None
                t0 = time.perf_counter()
                if prebuild_groups and new_layout is not None:
                    # Same process group before and after (same workers, same ranks): the new
                    # layout's sub-groups can form now instead of in the pause. Every rank does
                    # this in the same order; the training thread creates no groups meanwhile.
                    # Before the priority drops below: gloo's threads inherit this one's.
                    groups = self._make_groups(new_layout, new_rank)
                groups_s = time.perf_counter() - t0
                if self.device.type == "cpu" and self.cfg.stage_nice is not None:
                    # On a CPU host staging (page faults, mostly in the kernel) competes with
                    # the training thread for the same cores; at a low priority it runs when
                    # training waits (collectives, pipeline bubbles, chunk boundaries).
                    with contextlib.suppress(OSError):
                        os.setpriority(
                            os.PRIO_PROCESS, threading.get_native_id(), self.cfg.stage_nice
                        )
                staging.result = self._stage(plan, new_layout, new_rank, peer_flats, pull_pairs)
                if groups is not None:
                    staging.result.extra["groups"] = groups
                    staging.result.profile.phases["groups"] = {"wall_s": groups_s}
            except BaseException as exc:  # re-raised by switch_prepare
                staging.error = exc
            finally:
                # The runner waits on these keys without taking the worker's pipe (it is busy
                # with training commands meanwhile).
                self.store.set(done_key, "error" if staging.error else "ok")

        staging.thread = threading.Thread(target=work, name="greenflow-stage", daemon=True)
        self._staging = staging
        staging.thread.start()

    def _stage(
        self,
        plan: SwitchPlan,
        new_layout: Layout | None,
        new_rank: int,
        peer_flats: dict[int, torch.Tensor] | None = None,
        pull_pairs: frozenset[tuple[int, int]] = frozenset(),
    ) -> StagedSwitch:
        new_numel = None
        if new_layout is not None:
            new_smap = self._smap(new_layout, new_rank)
            new_numel = new_smap.n_state_elems
            n_grad = new_smap.n_param_elems
        staged = stage_switch(
            plan,
            self.cfg.worker_id,
            self.flat,
            new_numel,
            self.buffers,
            alloc=self._alloc_state,
            direct_min_run_bytes=self.cfg.direct_min_run_bytes,
            peer_flats=peer_flats,
            pull_pairs=pull_pairs,
        )
        old_grad = self.grad_flat
        if new_numel is not None and not staged.identity:
            if old_grad is not None and old_grad.numel() >= n_grad:
                # The old layout's gradient buffer is big enough: every step overwrites the
                # whole buffer, so the new layout takes a view of it at commit (no fresh pages:
                # faulting them cost 0.1-0.5 s of kernel CPU per 400 MB while training ran).
                staged.extra["grad"] = old_grad[:n_grad]
            else:
                # A new gradient buffer, faulted in now, so the first step after the switch
                # does not fault in fresh pages either.
                staged.extra["grad"] = torch.zeros(n_grad, device=self.device)
            staged.profile.mark("grad")
        if new_layout is not None:
            self._prepare(staged, new_layout, new_rank)
        return staged

    def cmd_switch_prepare(
        self,
        plan: SwitchPlan | None,
        group_rank: dict[int, int],
        new_layout: Layout | None,
        new_rank: int,
        step: int,
        switch_id: int | None = None,
    ) -> ExecStats:
        """Move state into a new buffer for (new_layout, new_rank); the old one stays intact.

        Uses what `switch_stage` prepared for `switch_id` (waiting for it if it is still
        running); without a staged switch, stages `plan` now.
        """
        if self.cfg.fail_at == "switch":
            os._exit(17)
        staging, self._staging = self._staging, None
        try:
            if self.cfg.fail_at == "transfer":
                self.cfg = dataclasses.replace(self.cfg, fail_at=None)
                raise RuntimeError("injected transfer failure (test hook)")
            t0 = time.perf_counter()
            if staging is not None and staging.switch_id == switch_id:
                assert staging.thread is not None
                staging.thread.join()
                if staging.error is not None:
                    raise staging.error
                assert staging.result is not None
                staged = staging.result
            else:
                if plan is None:
                    raise RuntimeError(f"switch {switch_id} was not staged on this worker")
                staged = self._stage(plan, new_layout, new_rank)
            wait_s = time.perf_counter() - t0
            # Unmapping them costs tens of ms per GB mapped: it waits for the retired state,
            # after the pause (commit), or happens at abort.
            self._peer_maps = list(staged.peer_flats.values())
            stats = run_switch(staged, self.flat, group_rank)
            stats.stage_wait_s = wait_s
        except Exception:
            # Leave the group at once so peers blocked on our messages fail now, not at timeout;
            # the runner forms a new generation for the rollback anyway.
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self._pending = (new_layout, new_rank, staged.new_flat, step, staged.extra)
        return stats

    def cmd_switch_commit(self) -> tuple[torch.Tensor, Layout, int] | None:
        """Adopt the prepared state; a worker that leaves frees its memory.

        Returns the new state's shared-memory handle when the runner keeps one.
        """
        if self.cfg.fail_at == "commit":
            os._exit(17)
        assert self._pending is not None
        layout, rank, flat, step, extra = self._pending
        self._pending = None
        # Kept (references only, no copy) until the switch is final, so that a failure in the
        # rest of the pause can put this worker back in the old layout.
        self._undo = {k: getattr(self, k) for k in _UNDO_FIELDS}
        self._retired.append(self._peer_maps)
        self._peer_maps = []
        if layout is None or flat is None:
            # Leaving: the memory goes back when the process exits, after the pause; unmapping
            # the gradient and staging buffers here would cost tens of ms inside it.
            self._retired += [self.flat, self.params, self.grad_flat, self.buffers]
            self.flat, self.params, self.grad_flat, self.smap = None, {}, None, None
            self.layout, self.rank = None, -1
            self.buffers = StagingBuffers(self.device)
            return None
        grad = self.grad_flat if flat is self.flat else extra.get("grad")
        # Freed after the pause (see worker_main), not in it.
        self._retired += [self.flat, self.params, self.grad_flat]
        self._install(layout, rank, flat, step, extra.get("stage_model"))
        self.grad_flat = grad
        if "groups" in extra:
            self._old_groups += [g for g in (self.tp.group, self.dp_group) if g is not None]
            self.tp, self.dp_group = extra["groups"]
        return self.cmd_state_handle()

    def cmd_switch_abort(self) -> None:
        """Drop the prepared (or staging) state and keep the old one; after a commit that is
        not final yet, go back to the state the commit replaced."""
        self._pending = None
        self._peer_maps = []
        undo, self._undo = self._undo, None
        if undo is not None:
            for k, v in undo.items():
                setattr(self, k, v)
            # Sub-groups of the abandoned layout (prebuilt ones included) are not kept; the
            # runner forms a new generation for the rollback, which destroys them.
            self._old_groups = []
        staging, self._staging = self._staging, None
        if staging is not None and staging.thread is not None:
            staging.thread.join()

    def cmd_save_checkpoint(self, path: str) -> float:
        """Write this worker's state to `path` (checkpoint-and-restart baseline); returns seconds."""
        assert self.flat is not None
        t0 = time.perf_counter()
        torch.save({"flat": self.flat.cpu(), "step": self.step}, path)
        return time.perf_counter() - t0

    def cmd_load_checkpoint(
        self, layout: Layout, rank: int, plan: SwitchPlan, files: dict[int, str]
    ) -> float:
        """Build state for (layout, rank) from per-rank checkpoint files, resharding on load."""
        t0 = time.perf_counter()
        smap = self._smap(layout, rank)
        flat = self._alloc_state(smap.n_state_elems)
        step = 0
        for src, ts in plan.recvs_of(self.cfg.worker_id).items():
            ckpt = torch.load(files[src], mmap=True, weights_only=True)
            step = int(ckpt["step"])
            for t in ts:
                flat[t.dst_offset : t.dst_offset + t.numel].copy_(
                    ckpt["flat"][t.src_offset : t.src_offset + t.numel]
                )
        self._install(layout, rank, flat, step)
        self._build_groups()
        return time.perf_counter() - t0

    def cmd_p2p_probe(self, pairs: list[tuple[int, int, int]], repeats: int, fresh: bool) -> float:
        """Median seconds of a plain batched send/recv of (src_rank, dst_rank, numel).

        Send buffers are warm; receive buffers are warm too unless `fresh`, in which case each
        round receives into newly allocated memory, as a switch must for a new shard.
        """
        me = dist.get_rank()
        mine = [(s, d, n) for s, d, n in pairs if me in (s, d)]
        warm = [torch.ones(n, device=self.device) for _, _, n in mine]

        def once() -> float:
            bufs = [
                torch.empty(n, device=self.device) if fresh and d == me else b
                for (_, d, n), b in zip(mine, warm, strict=True)
            ]
            ops = [
                dist.P2POp(dist.isend, b, d) if s == me else dist.P2POp(dist.irecv, b, s)
                for (s, d, _), b in zip(mine, bufs, strict=True)
            ]
            dist.barrier()
            t0 = time.perf_counter()
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            return time.perf_counter() - t0

        once()  # warm-up: connections and first touch of the warm buffers
        times = sorted(once() for _ in range(repeats))
        return times[len(times) // 2]

    def cmd_shm_probe_buffers(self, pairs: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Warm shared-memory send buffers, one per (src_rank, dst_rank, numel) this rank sends."""
        me = dist.get_rank()
        out = []
        for s, _, n in pairs:
            if s == me:
                storage = torch.UntypedStorage._new_shared(n * 4)
                out.append(torch.empty(0).set_(storage).fill_(1.0))
        return out

    def cmd_shm_probe(
        self, pairs: list[tuple[int, int, int]], sources: list[torch.Tensor | None], repeats: int
    ) -> float:
        """Median seconds for this rank to copy every pair it receives out of the sender's
        shared-memory buffer (`sources[i]` for `pairs[i]`) into a warm buffer of its own.

        Both sides' pages are faulted in beforehand, as a staged switch's are.
        """
        me = dist.get_rank()
        mine = [(src, n) for (_, d, n), src in zip(pairs, sources, strict=True) if d == me]
        srcs = [src for src, _ in mine if src is not None]
        assert len(srcs) == len(mine), "a receiver needs every sender's buffer"
        dsts = [torch.ones(n) for _, n in mine]
        for src in srcs:
            float(src[:: 4096 // src.element_size()].sum())

        def once() -> float:
            dist.barrier()
            t0 = time.perf_counter()
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            return time.perf_counter() - t0

        once()  # warm-up, as for the p2p probe
        times = sorted(once() for _ in range(repeats))
        return times[len(times) // 2]

    def cmd_arm_fault(self, mode: str) -> None:
        """Test hook: in the next switch, exit (`switch`, `stage`, `commit`, `regroup`) or raise
        (`transfer`)."""
        self.cfg = dataclasses.replace(self.cfg, fail_at=mode)

    def cmd_build_groups(self) -> None:
        """Create the current layout's TP/DP sub-groups (after a join)."""
        self._fail_if_committed()
        self._build_groups()

    def _fail_if_committed(self) -> None:
        """Test hook `regroup`: exit abruptly in the group rebuild that follows a commit."""
        if self.cfg.fail_at == "regroup" and self._undo is not None:
            os._exit(17)


_PAUSE_COMMANDS = frozenset({"switch_commit", "build_groups", "join", "switch_abort"})
"""Commands the runner sends inside a switch's pause (and its rollback): they keep the state a
commit replaced, which the first other command frees."""

_UNDO_FIELDS = (
    "stage",
    "optimizer",
    "layout",
    "rank",
    "step",
    "smap",
    "flat",
    "params",
    "grad_flat",
    "buffers",
    "tp",
    "dp_group",
)
"""Worker attributes a commit replaces and `switch_abort` restores."""


@dataclass
class _Staging:
    """A switch being staged in a worker thread."""

    switch_id: int
    thread: threading.Thread | None = None
    result: StagedSwitch | None = None
    error: BaseException | None = None


def make_worker(cfg: WorkerConfig) -> Worker:
    """The worker for the job's kind: a user's nn.Module job, or a built-in functional preset."""
    spec = JobSpec.model_validate_json(cfg.spec_json)
    if not is_module_job(spec):
        return Worker(cfg)
    # Imported here: module_worker builds on this module's Worker.
    from worker_agent.runtime.module_worker import ModuleWorker

    return ModuleWorker(cfg)


def _capture_output(path: str) -> None:
    """Point file descriptors 1 and 2 at `path` (appending), line-buffered for Python's prints."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115


def _error_status(exc: BaseException) -> str:
    # "job_error": the job's own definition is at fault (the parent fails the job, no retry).
    return "job_error" if isinstance(exc, JobSpecError) else "error"


def worker_main(conn: Channel, cfg: WorkerConfig) -> None:
    """Entry point of a worker process: answer commands until `exit`."""
    if cfg.log_path is not None:
        _capture_output(cfg.log_path)
    torch.set_num_threads(1)
    if cfg.socket_ifname is not None:
        # Read when the first process group is created, i.e. after this point.
        os.environ["GLOO_SOCKET_IFNAME"] = cfg.socket_ifname
        os.environ["NCCL_SOCKET_IFNAME"] = cfg.socket_ifname
    try:
        worker = make_worker(cfg)
    except Exception as exc:  # report start-up failures instead of dying silently
        conn.send((_error_status(exc), f"{type(exc).__name__}: {exc}"))
        return
    if cfg.log_path is not None:
        joblog.bind(cfg.log_path + ".scalars", lambda: (worker.step, worker.rank))
    conn.send(("ok", os.getpid()))
    while True:
        try:
            cmd, kwargs = conn.recv()
        except (EOFError, OSError):  # the runner is gone (or, across nodes, unreachable)
            break
        if cmd == "exit":
            conn.send(("ok", None))
            break
        if worker._retired and cmd not in _PAUSE_COMMANDS:
            # The state a switch replaced is freed by the first command after the pause: in a
            # thread when training resumes (overlapping it), else at once, so that it never
            # lingers into the next switch (two old copies of the state do not fit in memory).
            worker.free_retired(background=cmd == "train")
        handler: Callable[..., Any] = getattr(worker, f"cmd_{cmd}")
        try:
            conn.send(("ok", handler(**kwargs)))
        except Exception as exc:
            conn.send(
                (
                    _error_status(exc),
                    f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}",
                )
            )
        # Arguments can map other processes' shared memory (a switch's peer buffers, a probe's
        # sources): holding them until the next command kept GBs alive and moved the unmapping
        # into the next command, i.e. into a switch's pause.
        del kwargs
    if dist.is_initialized():
        dist.destroy_process_group()
