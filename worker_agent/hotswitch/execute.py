"""The switch executor, run inside each worker, in two phases.

`stage_switch` runs while the job still trains (in a worker thread): it works out every message,
allocates the new shard buffer and the staging buffers and touches every page of them, so that
no page fault lands inside the pause. `run_switch` runs in the pause: it packs the few small
runs, posts every send and receive at once (`batch_isend_irecv`), copies what the worker already
holds into the new buffer while the messages fly, and unpacks the small runs. The old buffer is
only ever read, so a failed switch leaves it intact.

Runs contiguous in both the sender's and the receiver's flat buffer travel as their own message,
sent from and received into views of the state buffers (zero copy); only runs smaller than
`DIRECT_MIN_RUN_BYTES` are fused into one packed message per peer.

Peers whose old state buffer the receiver can map (CPU workers on one node whose state lives in
shared memory; the runner passes the handles) send no messages at all: the receiver copies the
runs straight out of the sender's buffer in the pause ("pulls"), one memory copy instead of a
send, the kernel's two copies through the loopback socket and a receive. Nothing writes an old
buffer in the pause, so the reads need no synchronisation beyond the pause itself.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from worker_agent.hotswitch.plan import LocalCopy, SwitchPlan, Transfer

DIRECT_MIN_RUN_BYTES = 512 * 1024
"""Runs at least this large travel as their own message instead of being packed."""

Run = tuple[int, int, int]
"""(offset in the sender's flat buffer, offset in the receiver's, elements)."""


def _thread_sample() -> tuple[float, float, float, float, float, float, float]:
    """Wall clock and the calling thread's user/sys CPU s, run-queue wait s, minor page
    faults, voluntary and involuntary context switches (Linux)."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    try:
        with open("/proc/thread-self/schedstat") as f:
            runq_s = int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        runq_s = 0.0
    return (
        time.perf_counter(),
        ru.ru_utime,
        ru.ru_stime,
        runq_s,
        float(ru.ru_minflt),
        float(ru.ru_nvcsw),
        float(ru.ru_nivcsw),
    )


_SAMPLE_KEYS = ("wall_s", "user_s", "sys_s", "runq_s", "minflt", "vcsw", "ivcsw")


class PhaseProfile:
    """Where one thread's time went, phase by phase: wall, user and kernel CPU, time waiting
    for a core (run queue), page faults, context switches. Wall minus CPU minus run-queue wait
    is time blocked (the GIL, locks, I/O)."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self._last = _thread_sample()

    def mark(self, name: str) -> None:
        """Close the phase `name` (time since the previous mark)."""
        now = _thread_sample()
        acc = self.phases.setdefault(name, dict.fromkeys(_SAMPLE_KEYS, 0.0))
        for k, a, b in zip(_SAMPLE_KEYS, self._last, now, strict=True):
            acc[k] += b - a
        self._last = now


@dataclass
class ExecStats:
    """Where one worker's switch time went and how many bytes it moved."""

    stage_s: float = 0.0
    """Allocating and pre-faulting the new buffers (before the pause, overlapping training)."""
    stage_wait_s: float = 0.0
    """Part of staging that was still running when the pause began (inside the pause)."""
    local_s: float = 0.0
    pack_s: float = 0.0
    comm_s: float = 0.0
    unpack_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    bytes_pulled: int = 0
    """Received by copying out of a peer's shared-memory buffer (no message)."""
    pull_s: float = 0.0
    """Copying the pulled runs (inside comm_s)."""
    messages: int = 0
    zero_copy_messages: int = 0
    posted_at: float = 0.0
    """`time.perf_counter()` when the messages were posted (one clock for all local processes)."""
    stage_profile: dict[str, dict[str, float]] = field(default_factory=dict)
    """Staging per phase (`PhaseProfile`), as the staging thread saw it."""


class StagingBuffers:
    """Grow-only send and receive staging buffers, reused across switches."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._send = torch.empty(0, device=device)
        self._recv = torch.empty(0, device=device)

    def send(self, numel: int) -> torch.Tensor:
        """A send staging buffer of at least `numel` elements (pre-faulted when new)."""
        if self._send.numel() < numel:
            self._send = torch.zeros(numel, device=self.device)
        return self._send

    def recv(self, numel: int) -> torch.Tensor:
        """A receive staging buffer of at least `numel` elements (pre-faulted when new)."""
        if self._recv.numel() < numel:
            self._recv = torch.zeros(numel, device=self.device)
        return self._recv

    def release(self) -> None:
        """Give the staging memory back (a worker leaving the job)."""
        self._send = torch.empty(0, device=self.device)
        self._recv = torch.empty(0, device=self.device)


@dataclass
class StagedSwitch:
    """One worker's part of a switch, prepared before the pause."""

    new_flat: torch.Tensor | None
    """The new shard buffer, every page touched; the old buffer itself when nothing changes."""
    identity: bool
    local: list[Run]
    sends: dict[Any, tuple[list[Run], list[Run]]]
    """Per receiver: (small runs to fuse, big runs to send unpacked), in the order both use."""
    recvs: dict[Any, tuple[list[Run], list[Run]]]
    pulls: dict[Any, list[Run]]
    """Per sender whose old buffer is mapped here: runs to copy out of it."""
    peer_flats: dict[Any, torch.Tensor]
    """Those senders' old state buffers (shared memory, read only)."""
    send_staging: torch.Tensor | None
    recv_staging: torch.Tensor | None
    elem_bytes: int
    stage_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    profile: PhaseProfile = field(default_factory=PhaseProfile)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Many contiguous copies in one call (torch's foreach kernel; a loop if it is missing)."""
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        # One C++ call instead of one Python round-trip per piece: pieces number in the thousands.
        foreach(dst, src)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


def _is_identity(copies: Sequence[LocalCopy], old_numel: int, new_numel: int) -> bool:
    """True when the new buffer would be a byte-for-byte copy of the old one."""
    return (
        old_numel == new_numel
        and all(c.src_offset == c.dst_offset for c in copies)
        and sum(c.numel for c in copies) == new_numel
    )


def _runs2(triples: Sequence[Run]) -> list[Run]:
    """Coalesce (src, dst, numel) copies that continue each other on both sides."""
    out: list[Run] = []
    for s, d, n in triples:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


def _split(
    ts: Sequence[Transfer], elem_bytes: int, min_run_bytes: int
) -> tuple[list[Run], list[Run]]:
    """A peer's (src, dst, numel) runs: (small ones to fuse, big ones to send unpacked).

    Packing costs a memory pass on each side (the prototype spent ~70 % of a switch there);
    for big runs one more message is far cheaper than that pass. Both sides compute the same
    split from the same ordered piece list, so their messages match one to one.
    """
    runs = _runs2([(t.src_offset, t.dst_offset, t.numel) for t in ts])
    small = [r for r in runs if r[2] * elem_bytes < min_run_bytes]
    big = [r for r in runs if r[2] * elem_bytes >= min_run_bytes]
    return small, big


def _fused(split: Mapping[Any, tuple[list[Run], list[Run]]]) -> int:
    """Elements that go through a staging buffer (peers with more than one small run)."""
    return sum(sum(r[2] for r in small) for small, _ in split.values() if len(small) > 1)


def _prefault_reads(flat: torch.Tensor, runs: Sequence[Run]) -> None:
    """Map every page of `flat` that `runs` read (one element per 4 KiB page is enough).

    A peer's buffer is a fresh mapping in this process: its first read of each page is a page
    fault, which would otherwise land in the pause (~0.4 s per 600 MB here vs ~0.1 s warm).
    """
    step = 4096 // flat.element_size()
    for s_off, _, k in runs:
        float(flat[s_off : s_off + k : step].sum())


def stage_switch(
    plan: SwitchPlan,
    me: int,
    old_flat: torch.Tensor | None,
    new_numel: int | None,
    buffers: StagingBuffers,
    alloc: Callable[[int], torch.Tensor] | None = None,
    direct_min_run_bytes: int | None = None,
    peer_flats: Mapping[Any, torch.Tensor] | None = None,
    pull_pairs: frozenset[tuple[Any, Any]] = frozenset(),
) -> StagedSwitch:
    """Everything of a switch that does not read the (still training) state: messages, buffers.

    `pull_pairs` are the (sender, receiver) pairs that move no message because the receiver
    copies out of the sender's buffer; `peer_flats` holds those buffers for the senders to `me`.
    """
    t0 = time.perf_counter()
    prof = PhaseProfile()
    min_run = DIRECT_MIN_RUN_BYTES if direct_min_run_bytes is None else direct_min_run_bytes
    copies = [c for c in plan.local_copies if c.worker == me]
    old_n = 0 if old_flat is None else old_flat.numel()
    identity = new_numel is not None and old_flat is not None
    identity = identity and _is_identity(copies, old_n, new_numel or 0)
    new_flat: torch.Tensor | None = None
    if identity:
        # Nothing in this worker's state changes: share the buffer (it is read-only until
        # commit, so rollback stays possible).
        new_flat = old_flat
    elif new_numel is not None:
        new_flat = alloc(new_numel) if alloc is not None else torch.empty(new_numel)
        prof.mark("alloc")
        # First touch here, not in the pause: on this machine a fresh page costs more than
        # copying it (~0.35 s per 400 MB faulted vs ~0.03 s warm).
        new_flat.zero_()
        prof.mark("fault_new")
    sends = {
        p: _split(ts, plan.elem_bytes, min_run)
        for p, ts in plan.sends_of(me).items()
        if (me, p) not in pull_pairs
    }
    recvs = {
        p: _split(ts, plan.elem_bytes, min_run)
        for p, ts in plan.recvs_of(me).items()
        if (p, me) not in pull_pairs
    }
    flats = dict(peer_flats or {})
    pulls = {
        p: _runs2([(t.src_offset, t.dst_offset, t.numel) for t in ts])
        for p, ts in plan.recvs_of(me).items()
        if (p, me) in pull_pairs
    }
    missing = [p for p in pulls if p not in flats]
    if missing:
        raise RuntimeError(f"no shared state buffer of workers {missing} to copy from")
    prof.mark("runs")
    for p, runs in pulls.items():
        _prefault_reads(flats[p], runs)
    prof.mark("fault_peers")
    n_send, n_recv = _fused(sends), _fused(recvs)
    local = [] if identity else _runs2([(c.src_offset, c.dst_offset, c.numel) for c in copies])
    send_staging = buffers.send(n_send) if n_send else None
    recv_staging = buffers.recv(n_recv) if n_recv else None
    prof.mark("staging_buffers")
    return StagedSwitch(
        new_flat=new_flat,
        identity=identity,
        local=local,
        sends=sends,
        recvs=recvs,
        pulls=pulls,
        peer_flats={p: flats[p] for p in pulls},
        send_staging=send_staging,
        recv_staging=recv_staging,
        elem_bytes=plan.elem_bytes,
        stage_s=time.perf_counter() - t0,
        profile=prof,
    )


def run_switch(
    staged: StagedSwitch,
    old_flat: torch.Tensor | None,
    group_rank: Mapping[Any, int],
    group: dist.ProcessGroup | None = None,
    overlap_local: bool = True,
) -> ExecStats:
    """The paused part of a switch: pack small runs, post all messages, local copies, unpack."""
    stats = ExecStats(stage_s=staged.stage_s, stage_profile=staged.profile.phases)
    eb = staged.elem_bytes
    new_flat = staged.new_flat
    ops: list[dist.P2POp] = []

    t0 = time.perf_counter()
    pos = 0
    for peer, (small, big) in staged.sends.items():
        assert old_flat is not None, "a worker without state cannot send"
        msgs: list[torch.Tensor] = []
        if len(small) == 1:
            s_off, _, k = small[0]
            msgs.append(old_flat[s_off : s_off + k])
        elif small:
            assert staged.send_staging is not None
            n = sum(k for _, _, k in small)
            msg = staged.send_staging[pos : pos + n]
            views, cur = [], 0
            for _, _, k in small:
                views.append(msg[cur : cur + k])
                cur += k
            _copy_all(views, [old_flat[s_off : s_off + k] for s_off, _, k in small])
            msgs.append(msg)
            pos += n
        msgs += [old_flat[s_off : s_off + k] for s_off, _, k in big]
        stats.zero_copy_messages += len(big) + (len(small) == 1)
        for m in msgs:
            ops.append(dist.P2POp(dist.isend, m, group_rank[peer], group))
            stats.bytes_sent += m.numel() * eb
    stats.pack_s = time.perf_counter() - t0

    pos = 0
    unpack_dst: list[torch.Tensor] = []
    unpack_src: list[torch.Tensor] = []
    for peer, (small, big) in staged.recvs.items():
        assert new_flat is not None, "a leaving worker cannot receive"
        msgs = []
        if len(small) == 1:
            _, d_off, k = small[0]
            msgs.append(new_flat[d_off : d_off + k])
        elif small:
            assert staged.recv_staging is not None
            n = sum(k for _, _, k in small)
            msg = staged.recv_staging[pos : pos + n]
            cur = 0
            for _, d_off, k in small:
                unpack_dst.append(new_flat[d_off : d_off + k])
                unpack_src.append(msg[cur : cur + k])
                cur += k
            msgs.append(msg)
            pos += n
        msgs += [new_flat[d_off : d_off + k] for _, d_off, k in big]
        stats.zero_copy_messages += len(big) + (len(small) == 1)
        for m in msgs:
            ops.append(dist.P2POp(dist.irecv, m, group_rank[peer], group))
            stats.bytes_received += m.numel() * eb
    stats.messages = len(ops)

    errors: list[BaseException] = []

    def local_copies() -> None:
        t = time.perf_counter()
        try:
            assert old_flat is not None and new_flat is not None
            _copy_all(
                [new_flat[d : d + n] for _, d, n in staged.local],
                [old_flat[s : s + n] for s, _, n in staged.local],
            )
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
        stats.local_s = time.perf_counter() - t

    stats.bytes_local = sum(n for _, _, n in staged.local) * eb
    pull_dst: list[torch.Tensor] = []
    pull_src: list[torch.Tensor] = []
    for peer, runs in staged.pulls.items():
        assert new_flat is not None, "a leaving worker cannot receive"
        peer_flat = staged.peer_flats[peer]
        for s_off, d_off, k in runs:
            pull_dst.append(new_flat[d_off : d_off + k])
            pull_src.append(peer_flat[s_off : s_off + k])
    stats.bytes_pulled = sum(t.numel() for t in pull_dst) * eb
    stats.bytes_received += stats.bytes_pulled
    t0 = stats.posted_at = time.perf_counter()
    reqs = dist.batch_isend_irecv(ops) if ops else []
    # The local copies touch other parts of the new buffer than the messages do, so they run in
    # a thread while the transport moves the bytes (torch releases the GIL inside the copy).
    # Without messages in flight there is nothing to overlap: they run after the pulls, in this
    # thread (two copy threads per worker on two cores only compete for the same memory bus).
    copier: threading.Thread | None = None
    if staged.local and reqs and overlap_local:
        copier = threading.Thread(target=local_copies, name="greenflow-local-copy")
        copier.start()
    try:
        if pull_dst:
            t1 = time.perf_counter()
            _copy_all(pull_dst, pull_src)
            stats.pull_s = time.perf_counter() - t1
        for req in reqs:
            req.wait()
        # Until the last byte landed, whether or not the local copies are still running.
        stats.comm_s = time.perf_counter() - t0
        if staged.local and copier is None:
            local_copies()
    finally:
        if copier is not None:
            copier.join()
    if errors:
        raise errors[0]

    t0 = time.perf_counter()
    _copy_all(unpack_dst, unpack_src)
    stats.unpack_s = time.perf_counter() - t0
    return stats


def execute_plan(
    plan: SwitchPlan,
    me: int,
    old_flat: torch.Tensor | None,
    new_numel: int | None,
    group_rank: Mapping[Any, int],
    buffers: StagingBuffers,
    group: dist.ProcessGroup | None = None,
    direct_min_run_bytes: int | None = None,
    alloc: Callable[[int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, ExecStats]:
    """Stage and run this worker's part of `plan` at once; returns its new flat state."""
    staged = stage_switch(plan, me, old_flat, new_numel, buffers, alloc, direct_min_run_bytes)
    stats = run_switch(staged, old_flat, group_rank, group)
    return staged.new_flat, stats
