"""The switch planner: slice intersection of source and target shards, then sender choice.

Pure logic: holdings (which worker holds which range of which logical tensor, at which offset
of its flat buffer) in, a list of transfers and local copies out. Runs in the parent process and
is tested without any worker.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from worker_agent.sharding import Holding

WorkerId = int


class PlanError(Exception):
    """A target shard needs elements that no source worker holds (state was lost)."""


@dataclass(frozen=True)
class Transfer:
    """Send elements [start, end) of `tensor` from `src` (at src_offset) to `dst` (at dst_offset)."""

    src: WorkerId
    dst: WorkerId
    tensor: str
    start: int
    end: int
    src_offset: int
    dst_offset: int

    @property
    def numel(self) -> int:
        """Elements moved."""
        return self.end - self.start


@dataclass(frozen=True)
class LocalCopy:
    """Copy elements already held by `worker` from its old buffer into its new one."""

    worker: WorkerId
    tensor: str
    start: int
    end: int
    src_offset: int
    dst_offset: int

    @property
    def numel(self) -> int:
        """Elements copied."""
        return self.end - self.start


@dataclass
class SwitchPlan:
    """Every transfer and local copy of one switch, plus its volumes."""

    transfers: list[Transfer]
    local_copies: list[LocalCopy]
    elem_bytes: int
    bytes_lower_bound: int
    send_bytes: dict[WorkerId, int] = field(default_factory=dict)
    strategy: str = "balanced"
    bytes_cross_node: int = 0
    """Part of the moved bytes whose sender and receiver are on different nodes."""
    bytes_cross_node_min: int = 0
    """The least any sender choice moves between nodes: pieces no holder on the receiver's node
    has (the planner takes a same-node sender whenever there is one, so the two are equal)."""

    @property
    def bytes_moved(self) -> int:
        """Bytes that cross between workers."""
        return sum(t.numel for t in self.transfers) * self.elem_bytes

    @property
    def max_send_bytes(self) -> int:
        """The largest per-worker send volume."""
        return max(self.send_bytes.values(), default=0)

    def part_for(self, worker: WorkerId) -> SwitchPlan:
        """The transfers and local copies one worker takes part in (what it is sent)."""
        return SwitchPlan(
            transfers=[t for t in self.transfers if worker in (t.src, t.dst)],
            local_copies=[c for c in self.local_copies if c.worker == worker],
            elem_bytes=self.elem_bytes,
            bytes_lower_bound=self.bytes_lower_bound,
            send_bytes=dict(self.send_bytes),
            strategy=self.strategy,
            bytes_cross_node=self.bytes_cross_node,
            bytes_cross_node_min=self.bytes_cross_node_min,
        )

    def sends_of(self, worker: WorkerId) -> dict[WorkerId, list[Transfer]]:
        """Transfers `worker` sends, grouped by receiver, in the order both sides use."""
        out: dict[WorkerId, list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            if t.src == worker:
                out[t.dst].append(t)
        return dict(out)

    def recvs_of(self, worker: WorkerId) -> dict[WorkerId, list[Transfer]]:
        """Transfers `worker` receives, grouped by sender, in the order both sides use."""
        out: dict[WorkerId, list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            if t.dst == worker:
                out[t.src].append(t)
        return dict(out)


@dataclass
class _Piece:
    dst: WorkerId
    tensor: str
    start: int
    end: int
    dst_offset: int
    holders: list[tuple[WorkerId, int]]  # (worker, offset of `start` in its buffer)


def _subtract(a: int, b: int, cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of [a, b) not covered by the (disjoint, sorted) intervals `cuts`."""
    out: list[tuple[int, int]] = []
    pos = a
    for s, e in cuts:
        if e <= pos or s >= b:
            continue
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    if pos < b:
        out.append((pos, b))
    return out


def _pieces(
    src: Mapping[WorkerId, Sequence[Holding]],
    dst: Mapping[WorkerId, Sequence[Holding]],
) -> tuple[list[_Piece], list[LocalCopy]]:
    """Split every target need into local copies and remote pieces with their holders."""
    by_tensor: dict[str, list[tuple[WorkerId, Holding]]] = defaultdict(list)
    for w, hs in src.items():
        for h in hs:
            by_tensor[h.tensor].append((w, h))
    pieces: list[_Piece] = []
    local: list[LocalCopy] = []
    for w, needs in dst.items():
        own_multi: dict[str, list[Holding]] = defaultdict(list)
        for h in src.get(w, ()):
            own_multi[h.tensor].append(h)
        for need in needs:
            mine = sorted(own_multi.get(need.tensor, []), key=lambda h: h.start)
            for h in mine:
                s, e = max(h.start, need.start), min(h.end, need.end)
                if s < e:
                    local.append(
                        LocalCopy(
                            w,
                            need.tensor,
                            s,
                            e,
                            h.offset + s - h.start,
                            need.offset + s - need.start,
                        )
                    )
            others = [(o, h) for o, h in by_tensor.get(need.tensor, []) if o != w]
            for a, b in _subtract(need.start, need.end, [(h.start, h.end) for h in mine]):
                cuts = sorted(
                    {a, b}
                    | {h.start for _, h in others if a < h.start < b}
                    | {h.end for _, h in others if a < h.end < b}
                )
                prev: _Piece | None = None
                for s, e in itertools.pairwise(cuts):
                    holders = [
                        (o, h.offset + s - h.start)
                        for o, h in others
                        if h.start <= s and e <= h.end
                    ]
                    if not holders:
                        raise PlanError(
                            f"no worker holds {need.tensor}[{s}:{e}] needed by worker {w}; "
                            "restore the job from its last snapshot"
                        )
                    # Merge with the previous segment when every holder continues contiguously.
                    if (
                        prev is not None
                        and [o for o, _ in prev.holders] == [o for o, _ in holders]
                        and all(
                            po + (prev.end - prev.start) == no
                            for (_, po), (_, no) in zip(prev.holders, holders, strict=True)
                        )
                    ):
                        prev.end = e
                        continue
                    prev = _Piece(w, need.tensor, s, e, need.offset + s - need.start, holders)
                    pieces.append(prev)
    return pieces, local


def _candidates(p: _Piece, node_of: Mapping[WorkerId, str]) -> list[tuple[WorkerId, int]]:
    """Holders of a piece on the receiver's node, or all holders when none is."""
    near = [h for h in p.holders if _same_node(h[0], p.dst, node_of)]
    return near or p.holders


def _assign(
    pieces: list[_Piece], node_of: Mapping[WorkerId, str], strategy: str
) -> tuple[list[Transfer], dict[WorkerId, int]]:
    """Pick a sender per piece among the nearest holders.

    `first`: the first holder. `balanced`: forced pieces first, then largest first (LPT), each
    to the least-loaded holder. `sticky`: pieces in receiver order, keeping the previous sender of
    the same receiver while its load stays under an even share, so each receiver gets long
    contiguous runs from few senders (no unpacking) at the same largest send volume.
    """
    load: dict[WorkerId, int] = defaultdict(int)
    chosen: list[Transfer] = []
    order = list(range(len(pieces)))
    cap = 0.0
    if strategy == "balanced":
        order.sort(
            key=lambda i: (len(_candidates(pieces[i], node_of)), -(pieces[i].end - pieces[i].start))
        )
    elif strategy == "sticky":
        order.sort(key=lambda i: (str(pieces[i].dst), pieces[i].dst_offset))
        senders = {h[0] for p in pieces for h in _candidates(p, node_of)}
        total = sum(p.end - p.start for p in pieces)
        cap = total / max(1, len(senders))
    prev: dict[WorkerId, WorkerId] = {}
    for i in order:
        p = pieces[i]
        cands = _candidates(p, node_of)
        size = p.end - p.start
        if strategy == "first":
            sender, off = cands[0]
        elif strategy == "sticky" and any(
            h[0] == prev.get(p.dst) and load[h[0]] + size <= cap for h in cands
        ):
            sender, off = next(h for h in cands if h[0] == prev.get(p.dst))
        else:
            sender, off = min(cands, key=lambda h: load[h[0]])
        prev[p.dst] = sender
        load[sender] += size
        chosen.append(Transfer(sender, p.dst, p.tensor, p.start, p.end, off, p.dst_offset))
    return chosen, dict(load)


def _message_runs(transfers: list[Transfer]) -> int:
    """Messages the executor would need if every piece ran unpacked (fewer is better)."""
    runs = 0
    last: dict[tuple[WorkerId, WorkerId], Transfer] = {}
    for t in sorted(transfers, key=lambda t: (str(t.src), str(t.dst), t.dst_offset)):
        key = (t.src, t.dst)
        q = last.get(key)
        if (
            q is None
            or q.src_offset + q.numel != t.src_offset
            or q.dst_offset + q.numel != t.dst_offset
        ):
            runs += 1
        last[key] = t
    return runs


def build_plan(
    src: Mapping[WorkerId, Sequence[Holding]],
    dst: Mapping[WorkerId, Sequence[Holding]],
    node_of: Mapping[WorkerId, str] | None = None,
    elem_bytes: int = 4,
) -> SwitchPlan:
    """Plan a switch from the `src` holdings to the `dst` holdings (both keyed by worker)."""
    node_of = node_of or {}
    pieces, local = _pieces(src, dst)
    lower_bound = sum(p.end - p.start for p in pieces) * elem_bytes
    # The balancing strategies are heuristics: keep whichever gives the smallest largest send
    # volume, then the fewest messages; "first" is the reference they must never lose to.
    options = []
    for rank, name in enumerate(("sticky", "balanced", "first")):
        chosen, load = _assign(pieces, node_of, name)
        options.append(
            (max(load.values(), default=0), _message_runs(chosen), rank, name, chosen, load)
        )
    _, _, _, strategy, transfers, load = min(options, key=lambda o: o[:3])
    order = {w: i for i, w in enumerate(dict.fromkeys([*src, *dst]))}
    transfers.sort(key=lambda t: (order[t.src], order[t.dst], t.dst_offset))
    local.sort(key=lambda c: (order[c.worker], c.dst_offset))
    far = [p for p in pieces if not any(_same_node(h[0], p.dst, node_of) for h in p.holders)]
    return SwitchPlan(
        transfers=transfers,
        local_copies=local,
        elem_bytes=elem_bytes,
        bytes_lower_bound=lower_bound,
        send_bytes={w: n * elem_bytes for w, n in load.items()},
        strategy=strategy,
        bytes_cross_node=sum(t.numel for t in transfers if not _same_node(t.src, t.dst, node_of))
        * elem_bytes,
        bytes_cross_node_min=sum(p.end - p.start for p in far) * elem_bytes,
    )


def _same_node(a: WorkerId, b: WorkerId, node_of: Mapping[WorkerId, str]) -> bool:
    return node_of.get(a) == node_of.get(b)


def first_holder_max_send_bytes(
    src: Mapping[WorkerId, Sequence[Holding]],
    dst: Mapping[WorkerId, Sequence[Holding]],
    node_of: Mapping[WorkerId, str] | None = None,
    elem_bytes: int = 4,
) -> int:
    """Largest per-worker send volume when every piece goes to its first (nearest) holder."""
    pieces, _ = _pieces(src, dst)
    _, load = _assign(pieces, node_of or {}, "first")
    return max(load.values(), default=0) * elem_bytes
