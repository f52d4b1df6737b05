"""The switch executor, run inside each worker: local copies, fused batched p2p, contiguous unpack.

All pieces a worker sends to one peer travel as one message; when they are contiguous in the
sender's flat buffer the message is a view of that buffer (no packing), and likewise on the
receiving side (no unpacking). Otherwise pieces are packed into a reused staging buffer with
plain contiguous `copy_` calls, never gathers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from worker_agent.hotswitch.plan import LocalCopy, SwitchPlan, Transfer


@dataclass
class ExecStats:
    """Where one worker's switch time went and how many bytes it moved."""

    local_s: float = 0.0
    pack_s: float = 0.0
    comm_s: float = 0.0
    unpack_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    messages: int = 0
    zero_copy_messages: int = 0


class StagingBuffers:
    """Grow-only send and receive staging buffers, reused across switches."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._send = torch.empty(0, device=device)
        self._recv = torch.empty(0, device=device)

    def send(self, numel: int) -> torch.Tensor:
        """A send staging buffer of at least `numel` elements."""
        if self._send.numel() < numel:
            self._send = torch.empty(numel, device=self.device)
        return self._send

    def recv(self, numel: int) -> torch.Tensor:
        """A receive staging buffer of at least `numel` elements."""
        if self._recv.numel() < numel:
            self._recv = torch.empty(numel, device=self.device)
        return self._recv

    def release(self) -> None:
        """Give the staging memory back (a worker leaving the job)."""
        self._send = torch.empty(0, device=self.device)
        self._recv = torch.empty(0, device=self.device)


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


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Coalesce (offset, numel) pairs that follow each other into (offset, numel) runs."""
    out: list[tuple[int, int]] = []
    for off, n in pairs:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def _is_identity(copies: Sequence[LocalCopy], old_numel: int, new_numel: int) -> bool:
    """True when the new buffer would be a byte-for-byte copy of the old one."""
    return (
        old_numel == new_numel
        and all(c.src_offset == c.dst_offset for c in copies)
        and sum(c.numel for c in copies) == new_numel
    )


def execute_plan(
    plan: SwitchPlan,
    me: int,
    old_flat: torch.Tensor | None,
    new_numel: int | None,
    group_rank: Mapping[Any, int],
    buffers: StagingBuffers,
    group: dist.ProcessGroup | None = None,
    direct_min_run_bytes: int | None = None,
) -> tuple[torch.Tensor | None, ExecStats]:
    """Run this worker's part of `plan`; returns its new flat state (None when it leaves)."""
    min_run = DIRECT_MIN_RUN_BYTES if direct_min_run_bytes is None else direct_min_run_bytes

    def _direct(ts: Sequence[Transfer]) -> bool:
        return _is_direct(ts, plan.elem_bytes, min_run)

    stats = ExecStats()
    device = buffers.device
    t0 = time.perf_counter()
    copies = [c for c in plan.local_copies if c.worker == me]
    new_flat: torch.Tensor | None = None
    if new_numel is not None:
        old_n = 0 if old_flat is None else old_flat.numel()
        if old_flat is not None and _is_identity(copies, old_n, new_numel):
            # Nothing in this worker's state changes; share the buffer (the old one is read-only
            # until commit, so rollback stays possible).
            new_flat = old_flat
        else:
            new_flat = torch.empty(new_numel, device=device)
            if copies:
                assert old_flat is not None
                triples = _runs2([(c.src_offset, c.dst_offset, c.numel) for c in copies])
                _copy_all(
                    [new_flat[d : d + n] for _, d, n in triples],
                    [old_flat[s : s + n] for s, _, n in triples],
                )
        stats.bytes_local = sum(c.numel for c in copies) * plan.elem_bytes
    stats.local_s = time.perf_counter() - t0

    sends = plan.sends_of(me)
    recvs = plan.recvs_of(me)
    ops: list[dist.P2POp] = []
    unpack: list[tuple[torch.Tensor, list[Transfer]]] = []

    t0 = time.perf_counter()
    fused_send = {p: ts for p, ts in sends.items() if not _direct(ts) and len(_runs_src(ts)) > 1}
    send_total = sum(t.numel for ts in fused_send.values() for t in ts)
    staging = buffers.send(send_total) if send_total else None
    pos = 0
    for peer, ts in sends.items():
        assert old_flat is not None, "a worker without state cannot send"
        n = sum(t.numel for t in ts)
        stats.bytes_sent += n * plan.elem_bytes
        if _direct(ts):
            # Large pieces: one message per run straight from the state buffer, no packing.
            for s_off, _, k in _runs2(_triples(ts)):
                ops.append(
                    dist.P2POp(dist.isend, old_flat[s_off : s_off + k], group_rank[peer], group)
                )
                stats.zero_copy_messages += 1
            continue
        runs = _runs_src(ts)
        if len(runs) == 1:
            msg = old_flat[runs[0][0] : runs[0][0] + n]
            stats.zero_copy_messages += 1
        else:
            assert staging is not None
            msg = staging[pos : pos + n]
            dst_views, cur = [], 0
            for _, k in runs:
                dst_views.append(msg[cur : cur + k])
                cur += k
            _copy_all(dst_views, [old_flat[off : off + k] for off, k in runs])
            pos += n
        ops.append(dist.P2POp(dist.isend, msg, group_rank[peer], group))
    stats.pack_s = time.perf_counter() - t0

    fused_recv = {p: ts for p, ts in recvs.items() if not _direct(ts) and len(_runs_dst(ts)) > 1}
    recv_total = sum(t.numel for ts in fused_recv.values() for t in ts)
    rstaging = buffers.recv(recv_total) if recv_total else None
    pos = 0
    for peer, ts in recvs.items():
        assert new_flat is not None, "a leaving worker cannot receive"
        n = sum(t.numel for t in ts)
        stats.bytes_received += n * plan.elem_bytes
        if _direct(ts):
            for _, d_off, k in _runs2(_triples(ts)):
                ops.append(
                    dist.P2POp(dist.irecv, new_flat[d_off : d_off + k], group_rank[peer], group)
                )
                stats.zero_copy_messages += 1
            continue
        runs = _runs_dst(ts)
        if len(runs) == 1:
            msg = new_flat[runs[0][0] : runs[0][0] + n]
            stats.zero_copy_messages += 1
        else:
            assert rstaging is not None
            msg = rstaging[pos : pos + n]
            pos += n
            unpack.append((msg, ts))
        ops.append(dist.P2POp(dist.irecv, msg, group_rank[peer], group))
    stats.messages = len(ops)

    t0 = time.perf_counter()
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    stats.comm_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    for msg, ts in unpack:
        assert new_flat is not None
        src_views, dst_views, cur = [], [], 0
        for off, k in _runs_dst(ts):
            src_views.append(msg[cur : cur + k])
            dst_views.append(new_flat[off : off + k])
            cur += k
        _copy_all(dst_views, src_views)
    stats.unpack_s = time.perf_counter() - t0
    return new_flat, stats


def _runs2(triples: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Coalesce (src, dst, numel) copies that continue each other on both sides."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in triples:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


DIRECT_MIN_RUN_BYTES = 1 << 20
"""Runs at least this large (on average) go as their own messages instead of being packed."""


def _triples(ts: Sequence[Transfer]) -> list[tuple[int, int, int]]:
    return [(t.src_offset, t.dst_offset, t.numel) for t in ts]


def _is_direct(ts: Sequence[Transfer], elem_bytes: int, min_run_bytes: int) -> bool:
    """Send a peer's pieces as separate zero-copy messages (both sides decide the same way).

    Packing costs a memory pass on each side (the prototype spent ~70 % of a switch there);
    for large contiguous runs the per-message overhead is far smaller than that pass.
    """
    runs = _runs2(_triples(ts))
    if len(runs) <= 1:
        return False
    return sum(n for _, _, n in runs) * elem_bytes / len(runs) >= min_run_bytes


def _runs_src(ts: Sequence[Transfer]) -> list[tuple[int, int]]:
    return _runs([(t.src_offset, t.numel) for t in ts])


def _runs_dst(ts: Sequence[Transfer]) -> list[tuple[int, int]]:
    return _runs([(t.dst_offset, t.numel) for t in ts])
