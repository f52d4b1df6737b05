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

    # Per peer, runs contiguous on both sides; big runs travel as their own message straight
    # from/into the state buffers, the small ones are fused into one packed message.
    send_split = {p: _split(ts, plan.elem_bytes, min_run) for p, ts in sends.items()}
    recv_split = {p: _split(ts, plan.elem_bytes, min_run) for p, ts in recvs.items()}

    t0 = time.perf_counter()
    packed = [small for small, _ in send_split.values() if len(small) > 1]
    staging = buffers.send(sum(n for small in packed for _, _, n in small)) if packed else None
    pos = 0
    for peer, (small, big) in send_split.items():
        assert old_flat is not None, "a worker without state cannot send"
        msgs: list[torch.Tensor] = []
        if len(small) == 1:
            s_off, _, k = small[0]
            msgs.append(old_flat[s_off : s_off + k])
        elif small:
            assert staging is not None
            n = sum(k for _, _, k in small)
            msg = staging[pos : pos + n]
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
            stats.bytes_sent += m.numel() * plan.elem_bytes
    stats.pack_s = time.perf_counter() - t0

    packed_r = [small for small, _ in recv_split.values() if len(small) > 1]
    rstaging = buffers.recv(sum(n for small in packed_r for _, _, n in small)) if packed_r else None
    pos = 0
    unpack_views: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for peer, (small, big) in recv_split.items():
        assert new_flat is not None, "a leaving worker cannot receive"
        msgs = []
        if len(small) == 1:
            _, d_off, k = small[0]
            msgs.append(new_flat[d_off : d_off + k])
        elif small:
            assert rstaging is not None
            n = sum(k for _, _, k in small)
            msg = rstaging[pos : pos + n]
            cur = 0
            for _, d_off, k in small:
                unpack_views[0].append(new_flat[d_off : d_off + k])
                unpack_views[1].append(msg[cur : cur + k])
                cur += k
            msgs.append(msg)
            pos += n
        msgs += [new_flat[d_off : d_off + k] for _, d_off, k in big]
        stats.zero_copy_messages += len(big) + (len(small) == 1)
        for m in msgs:
            ops.append(dist.P2POp(dist.irecv, m, group_rank[peer], group))
            stats.bytes_received += m.numel() * plan.elem_bytes
    stats.messages = len(ops)

    t0 = time.perf_counter()
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    stats.comm_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    _copy_all(unpack_views[0], unpack_views[1])
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


DIRECT_MIN_RUN_BYTES = 512 * 1024
"""Runs at least this large travel as their own message instead of being packed."""


def _split(
    ts: Sequence[Transfer], elem_bytes: int, min_run_bytes: int
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """A peer's (src, dst, numel) runs: (small ones to fuse, big ones to send unpacked).

    Packing costs a memory pass on each side (the prototype spent ~70 % of a switch there);
    for big runs one more message is far cheaper than that pass. Both sides compute the same
    split from the same ordered piece list, so their messages match one to one.
    """
    runs = _runs2([(t.src_offset, t.dst_offset, t.numel) for t in ts])
    small = [r for r in runs if r[2] * elem_bytes < min_run_bytes]
    big = [r for r in runs if r[2] * elem_bytes >= min_run_bytes]
    return small, big
