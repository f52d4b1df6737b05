"""The hot switch as the runner drives it: plan, stage, pause (transfer, commit), rollback.

Everything up to the pause overlaps training (new workers boot, the runner plans, every worker
stages); only what needs the paused state happens in the pause. A switch that fails is rolled
back to the old layout (`SwitchFailed`, whose `report` is the failed attempt's `SwitchReport`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from worker_agent.hotswitch.execute import ExecStats
from worker_agent.hotswitch.plan import PlanError, SwitchPlan, build_plan
from worker_agent.runtime.errors import SwitchFailed, WorkerFailed
from worker_agent.runtime.pool import Call, WorkerHandle, WorkerPool
from worker_agent.sharding import STATE_KINDS, Holding, Layout, ParamSpec, shard_map

SnapshotPolicy = Literal["auto", "before_switch", "periodic", "none"]
Transport = Literal["auto", "p2p"]


@dataclass
class SwitchTimings:
    """Where one switch's time went, in seconds."""

    spawn_s: float = 0.0
    """Starting new workers; overlaps training (not part of switch_s)."""
    plan_s: float = 0.0
    """Planning in the runner; before the pause, overlaps training."""
    stage_s: float = 0.0
    """Staging before the pause as the runner waited for it; overlaps training."""
    snapshot_s: float = 0.0
    transfer_s: float = 0.0
    regroup_s: float = 0.0


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
    bytes_cross_node: int = 0
    """Part of bytes_moved whose sender and receiver are on different nodes."""
    bytes_cross_node_min: int = 0
    """The least any choice of senders would move between nodes."""


@dataclass
class RunState:
    """The job's current workers (by rank), layout and step; shared by runner and coordinator."""

    ranks: list[WorkerHandle] = field(default_factory=list)
    layout: Layout | None = None
    step: int = 0


@dataclass
class SwitchMove:
    """One switch's participants: old ranks, new ranks, who leaves, who joins, and the plan."""

    src: Layout
    dst: Layout
    old: list[WorkerHandle]
    target: list[WorkerHandle]
    leaving: list[WorkerHandle]
    added: list[WorkerHandle]
    plan: SwitchPlan

    @property
    def union(self) -> list[WorkerHandle]:
        """The transfer group: every worker that sends or receives, in group-rank order."""
        if self.added and self.leaving:
            return [*self.old, *self.added]
        return self.target if self.added else self.old

    @property
    def prebuilt(self) -> bool:
        """True when the process group does not change, so sub-groups can form while staging."""
        same = [h.worker_id for h in self.old] == [h.worker_id for h in self.target]
        return same and not self.leaving and not self.added


def overlap(a: list[Holding], b: list[Holding]) -> int:
    """Elements of `b` that are already in `a` (same logical tensor ranges)."""
    idx: dict[str, list[Holding]] = {}
    for h in a:
        idx.setdefault(h.tensor, []).append(h)
    total = 0
    for h in b:
        for g in idx.get(h.tensor, []):
            total += max(0, min(g.end, h.end) - max(g.start, h.start))
    return total


class SwitchCoordinator:
    """Plans, stages, executes and rolls back hot switches of one job's workers."""

    def __init__(
        self,
        pool: WorkerPool,
        run: RunState,
        param_specs: list[ParamSpec],
        n_blocks: int,
        snapshot_policy: SnapshotPolicy,
        shared_state: bool,
        transport: Transport,
        snapshot_every_steps: int,
        state_kinds: tuple[str, ...] = STATE_KINDS,
    ) -> None:
        self.pool = pool
        self.state_kinds = state_kinds
        self.run = run
        self.param_specs = param_specs
        self.n_blocks = n_blocks
        self.snapshot_policy = snapshot_policy
        self.shared_state = shared_state
        self.transport = transport
        self.snapshot_every_steps = snapshot_every_steps
        self.live: dict[int, tuple[torch.Tensor, Layout, int]] = {}
        """Shared-memory handles of every worker's current state (CPU, shared state only)."""
        self.snapshot: dict[int, tuple[torch.Tensor, Layout, int, int]] = {}
        self.snapshot_step: int | None = None
        self.switch_id = 0

    def holdings(self, layout: Layout, rank: int) -> list[Holding]:
        """What `rank` holds in `layout`."""
        return shard_map(self.param_specs, self.n_blocks, layout, rank, self.state_kinds).holdings()

    # ----- before the pause -----------------------------------------------------------------
    def assign_ranks(
        self,
        old_layout: Layout,
        new_layout: Layout,
        keep: list[WorkerHandle],
        added: list[WorkerHandle],
    ) -> list[WorkerHandle]:
        """Give each new rank the kept worker that already holds most of its shard."""
        old_rank = {h.worker_id: r for r, h in enumerate(self.run.ranks)}
        held = {h.worker_id: self.holdings(old_layout, old_rank[h.worker_id]) for h in keep}
        free = list(keep)
        ranked: list[WorkerHandle | None] = []
        for r in range(new_layout.world_size):
            need = self.holdings(new_layout, r)
            if free:
                best = max(
                    free, key=lambda h: (overlap(held[h.worker_id], need), -old_rank[h.worker_id])
                )
                if overlap(held[best.worker_id], need) > 0 or not added:
                    free.remove(best)
                    ranked.append(best)
                    continue
            ranked.append(None)
        spare = iter([*free, *added])
        return [h if h is not None else next(spare) for h in ranked]

    def plan(
        self,
        old_layout: Layout,
        new_layout: Layout,
        old: list[WorkerHandle],
        target: list[WorkerHandle],
        added: list[WorkerHandle],
    ) -> SwitchPlan:
        """The transfers from the old ranks' holdings to the new ranks' holdings."""
        src = {h.worker_id: self.holdings(old_layout, r) for r, h in enumerate(old)}
        dst = {h.worker_id: self.holdings(new_layout, r) for r, h in enumerate(target)}
        node_of = {h.worker_id: h.slot.node for h in [*old, *added]}
        return build_plan(src, dst, node_of)

    def stage(
        self,
        move: SwitchMove,
        between_chunks: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        """Have every worker stage its part (threads, training goes on) and wait until done.

        `between_chunks()` holds the runner between two training chunks (old workers are busy
        with training otherwise). A worker that dies or fails here is not handled here: the
        paused part of the switch meets the same failure and rolls back.
        """
        self.switch_id += 1
        new_rank = {h.worker_id: r for r, h in enumerate(move.target)}
        keys = {
            h.worker_id: f"stage/{self.switch_id}/{h.worker_id}" for h in [*move.old, *move.added]
        }
        pulls = self._pull_pairs(move.plan, [*move.old, *move.added])
        prebuild = SwitchMove(
            move.src, move.dst, move.old, move.target, [], move.added, move.plan
        ).prebuilt

        def calls(hs: list[WorkerHandle]) -> list[Call]:
            return [
                (
                    h,
                    "switch_stage",
                    {
                        "switch_id": self.switch_id,
                        "plan": move.plan.part_for(h.worker_id),
                        "new_layout": move.dst if h.worker_id in new_rank else None,
                        "new_rank": new_rank.get(h.worker_id, -1),
                        "done_key": keys[h.worker_id],
                        "prebuild_groups": prebuild,
                        "peer_flats": {s: self.live[s][0] for s, d in pulls if d == h.worker_id},
                        "pull_pairs": frozenset(p for p in pulls if h.worker_id in p),
                    },
                )
                for h in hs
            ]

        with contextlib.suppress(WorkerFailed):
            self.pool.call(calls(move.added))  # not yet driven by the training thread
            with between_chunks():
                self.pool.call(calls(move.old))
        deadline = time.monotonic() + self.pool.timeout_s
        handles = [*move.old, *move.added]
        while not self.pool.store.check(list(keys.values())):
            if time.monotonic() > deadline or not all(h.proc.is_alive() for h in handles):
                return
            # Not faster: each check is a store round trip through the runner's own TCPStore
            # server, on the cores training uses (this wait lasts seconds on a busy CPU host).
            time.sleep(0.02)

    def _pull_pairs(
        self, plan: SwitchPlan, handles: list[WorkerHandle]
    ) -> frozenset[tuple[int, int]]:
        """(sender, receiver) pairs where the receiver copies out of the sender's shared state."""
        if self.transport != "auto" or not self.shared_state:
            return frozenset()
        node = {h.worker_id: h.slot.node for h in handles}
        return frozenset(
            (t.src, t.dst)
            for t in plan.transfers
            if t.src in self.live and node.get(t.src) == node.get(t.dst)
        )

    def refresh_live(self) -> None:
        """Keep the shared-memory handles of every worker's current state."""
        self.live = {}
        if not self.shared_state:
            return
        handles = self.pool.call_all(self.run.ranks, "state_handle")
        self.live = {
            h.worker_id: v for h, v in zip(self.run.ranks, handles, strict=True) if v is not None
        }

    def after_chunk(self) -> None:
        """Between training chunks: the periodic snapshot, when the policy keeps one."""
        if (
            self.snapshot_policy in ("auto", "periodic")
            and not self.shared_state
            and (
                self.snapshot_step is None
                or self.run.step - self.snapshot_step >= self.snapshot_every_steps
            )
        ):
            # Between chunks, never inside a switch: the fallback if a unique holder dies.
            snaps = self.pool.call_all(self.run.ranks, "snapshot")
            self.snapshot = {h.worker_id: s for h, s in zip(self.run.ranks, snaps, strict=True)}
            self.snapshot_step = self.run.step

    # ----- the pause ------------------------------------------------------------------------
    def execute(self, move: SwitchMove, timings: SwitchTimings) -> SwitchReport:
        """The paused part: snapshot (per policy), transfer, two-phase commit, regroup."""
        pool, run = self.pool, self.run
        t_start = time.perf_counter()
        if self.shared_state and len(self.live) == len(move.old):
            # The state at the switch, kept without a copy: the old buffers are only read until
            # commit, and the runner's handles keep them alive if a worker dies.
            self.snapshot = {
                wid: (t, lay, rank, run.step) for wid, (t, lay, rank) in self.live.items()
            }
        elif self.snapshot_policy == "before_switch":
            t0 = time.perf_counter()
            snaps = pool.call_all(move.old, "snapshot")
            self.snapshot = {h.worker_id: s for h, s in zip(move.old, snaps, strict=True)}
            timings.snapshot_s = time.perf_counter() - t0
        elif self.snapshot_policy == "none":
            self.snapshot = {}
        # Otherwise (periodic) the last periodic snapshot of this layout stays the fallback.

        new_rank = {h.worker_id: r for r, h in enumerate(move.target)}
        union = move.union
        stats: list[ExecStats] = []
        try:
            gone = frozenset(h.worker_id for h in union if not h.proc.is_alive())
            if gone:
                # Lost while staging: roll back now rather than wait for a rendezvous (or a
                # transfer) with a dead process to time out.
                raise WorkerFailed(f"workers {sorted(gone)} died while staging the switch", gone)
            t0 = time.perf_counter()
            if move.added:
                pool.join(union)
            timings.regroup_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            group_rank = {h.worker_id: r for r, h in enumerate(union)}
            stats = pool.call(
                [
                    (
                        h,
                        "switch_prepare",
                        {
                            # Staged before the pause: the plan need not travel again.
                            "plan": None,
                            "group_rank": group_rank,
                            "new_layout": move.dst if h.worker_id in new_rank else None,
                            "new_rank": new_rank.get(h.worker_id, -1),
                            "step": run.step,
                            "switch_id": self.switch_id,
                        },
                    )
                    for h in union
                ]
            )
            timings.transfer_s = time.perf_counter() - t0
        except WorkerFailed as exc:
            return self.rollback(move, exc, t_start, timings)

        t0 = time.perf_counter()
        same_group = [h.worker_id for h in union] == [h.worker_id for h in move.target]
        try:
            # Two-phase: a worker keeps the state its commit replaced (references, no copy) until
            # the switch is final, i.e. until its first command after the pause. A worker lost
            # from here to the end of the group rebuild therefore still rolls back like one lost
            # in the transfer: `switch_abort` puts the survivors back in the old layout.
            handles = pool.call_all(union, "switch_commit")
            if not same_group:
                gone = frozenset(h.worker_id for h in union if not h.proc.is_alive())
                if gone:
                    # Caught before the rendezvous, which would wait for it until timeout_s.
                    raise WorkerFailed(f"workers {sorted(gone)} died in the commit", gone)
                pool.join(move.target)
            if not move.prebuilt:
                pool.call_all(move.target, "build_groups")
        except WorkerFailed as exc:
            return self.rollback(move, exc, t_start, timings)
        run.ranks = move.target
        run.layout = move.dst
        timings.regroup_s += time.perf_counter() - t0
        # Leavers exit only now: their interpreter teardown (~1 s of CPU) would otherwise compete
        # with the survivors' new process group for the same cores inside the pause.
        for h in move.leaving:
            pool.release(h, wait=False)
        report = self.report(move, timings, stats, t_start, group_rank=group_rank)
        # Handles of the new state; the old buffers are freed once nobody maps them (below).
        retired = [self.live, self.snapshot]
        self.live = {
            h.worker_id: v
            for h, v in zip(union, handles, strict=True)
            if v is not None and h.worker_id in new_rank
        }
        if self.shared_state:
            self.snapshot = {}
        if self.snapshot_policy != "none" and not self.shared_state:
            self.snapshot = {}  # a snapshot of the old layout cannot be restored in the new one
            self.snapshot_step = None
        # Reaping exited workers takes ~1 s of interpreter teardown; training need not wait for it.
        if move.leaving:
            pool.reap_later(move.leaving)
        # Unmapping the old state takes tens of ms; after the pause, in a thread.
        threading.Thread(target=retired.clear, name="greenflow-free", daemon=True).start()
        return report

    def report(
        self,
        move: SwitchMove,
        timings: SwitchTimings,
        stats: list[ExecStats],
        t_start: float,
        group_rank: dict[int, int] | None = None,
        error: str | None = None,
        recovered_from: str | None = None,
    ) -> SwitchReport:
        """The report of a switch that ended now (ok unless `error`)."""
        plan = move.plan
        pairs: dict[tuple[int, int], int] = {}
        if group_rank is not None:
            for t in plan.transfers:
                key = (group_rank[t.src], group_rank[t.dst])
                pairs[key] = pairs.get(key, 0) + t.numel * plan.elem_bytes
        return SwitchReport(
            src=move.src,
            dst=move.dst,
            step=self.run.step,
            ok=error is None,
            switch_s=time.perf_counter() - t_start,
            spawn_s=timings.spawn_s,
            snapshot_s=timings.snapshot_s,
            plan_s=timings.plan_s,
            transfer_s=timings.transfer_s,
            regroup_s=timings.regroup_s,
            bytes_moved=plan.bytes_moved,
            bytes_lower_bound=plan.bytes_lower_bound,
            bytes_local=sum(s.bytes_local for s in stats),
            max_send_bytes=plan.max_send_bytes,
            pack_s=max((s.pack_s for s in stats), default=0.0),
            comm_s=max((s.comm_s for s in stats), default=0.0),
            unpack_s=max((s.unpack_s for s in stats), default=0.0),
            exchange_s=max((s.pack_s + s.comm_s + s.unpack_s for s in stats), default=0.0),
            local_s=max((s.local_s for s in stats), default=0.0),
            stage_s=timings.stage_s,
            stage_wait_s=max((s.stage_wait_s for s in stats), default=0.0),
            pair_bytes=[(s, d, n) for (s, d), n in sorted(pairs.items())],
            bytes_pulled=sum(s.bytes_pulled for s in stats),
            messages=sum(s.messages for s in stats),
            workers_started=[h.pid for h in move.added],
            workers_released=[h.pid for h in move.leaving],
            stage_profile=[s.stage_profile for s in stats],
            error=error,
            recovered_from=recovered_from,
            bytes_cross_node=plan.bytes_cross_node,
            bytes_cross_node_min=plan.bytes_cross_node_min,
        )

    def rollback(
        self, move: SwitchMove, exc: WorkerFailed, t_start: float, timings: SwitchTimings
    ) -> SwitchReport:
        """Return to the old layout: replace dead workers, repair from replicas or the snapshot.

        Always raises `SwitchFailed` (carrying the failed attempt's report) or, when the state
        of a dead worker is lost, `WorkerFailed`.
        """
        pool, run = self.pool, self.run
        old_layout, old = move.src, move.old
        for h in move.added:
            pool.release(h)
        gone = set(exc.dead)
        try:
            pool.call([(h, "switch_abort", {}) for h in old if h.worker_id not in gone])
        except WorkerFailed as abort_exc:
            gone |= abort_exc.dead
        dead = [h for h in old if h.worker_id in gone or not h.proc.is_alive()]
        for h in dead:
            pool.kill(h)
        try:
            replacements = pool.spawn([h.slot for h in dead])
        except WorkerFailed as spawn_exc:
            # Their node is gone too: the survivors are back in the old layout (aborted above),
            # and `JobRunner.recover` can continue on the slots that are left.
            nodes = sorted({h.slot.node for h in dead})
            raise WorkerFailed(
                f"switch {old_layout} -> {move.dst} failed ({exc}) and workers on {nodes} "
                f"cannot be replaced there ({spawn_exc}); recover on the remaining slots",
                frozenset(gone),
            ) from spawn_exc
        by_id = {d.worker_id: r for d, r in zip(dead, replacements, strict=True)}
        ranked = [by_id.get(h.worker_id, h) for h in old]
        run.ranks = ranked
        pool.join(ranked)
        recovered = "old-layout"
        if dead:
            recovered = self._repair(old_layout, old, ranked, replacements, exc)
        run.layout = old_layout
        pool.call_all(ranked, "build_groups")
        self.refresh_live()
        timings.transfer_s = timings.regroup_s = 0.0
        report = self.report(
            SwitchMove(old_layout, move.dst, old, old, [], move.added, move.plan),
            timings,
            [],
            t_start,
            error=str(exc),
            recovered_from=recovered,
        )
        raise SwitchFailed(
            f"switch {old_layout} -> {move.dst} failed and was rolled back ({recovered}): {exc}",
            recovered,
            report,
        )

    def _repair(
        self,
        layout: Layout,
        old: list[WorkerHandle],
        ranked: list[WorkerHandle],
        replacements: list[WorkerHandle],
        exc: WorkerFailed,
    ) -> str:
        """Give replacement workers the dead ones' state: from replicas, else the snapshot."""
        pool, run = self.pool, self.run
        src = {
            h.worker_id: self.holdings(layout, r)
            for r, h in enumerate(ranked)
            if h not in replacements
        }
        dst = {h.worker_id: self.holdings(layout, r) for r, h in enumerate(ranked)}
        try:
            repair: SwitchPlan | None = build_plan(
                src, dst, {h.worker_id: h.slot.node for h in ranked}
            )
        except PlanError:
            repair = None
        if repair is not None:
            group_rank = {h.worker_id: r for r, h in enumerate(ranked)}
            pool.call(
                [
                    (
                        h,
                        "switch_prepare",
                        {
                            "plan": repair,
                            "group_rank": group_rank,
                            "new_layout": layout,
                            "new_rank": r,
                            "step": run.step,
                        },
                    )
                    for r, h in enumerate(ranked)
                ]
            )
            pool.call_all(ranked, "switch_commit")
            return "replicas"
        if self.snapshot:
            calls: list[Call] = []
            for r, h in enumerate(ranked):
                snap, lay, rank, step = self.snapshot[old[r].worker_id]
                calls.append(
                    (h, "restore", {"snap": snap, "layout": lay, "rank": rank, "step": step})
                )
            pool.call(calls)
            run.step = next(iter(self.snapshot.values()))[3]
            return f"snapshot@step{run.step}"
        raise WorkerFailed(
            f"{exc}; state of the dead workers is lost (no replica, no snapshot)"
        ) from exc

    def forget(self) -> None:
        """Drop every handle and snapshot (the job stopped)."""
        self.snapshot = {}
        self.live = {}
        self.snapshot_step = None
