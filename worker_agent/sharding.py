"""Shard and layout geometry shared by the runtime and the hot switch.

A parallel layout (`Layout`: dp, tp, pp) orders ranks TP fastest, then DP, then PP. A job's
parameters are *logical* tensors (`ParamSpec`: full shape, TP split, pipeline unit); a rank holds
one contiguous range of each flattened logical tensor it needs (`shard_map`). A worker keeps its
whole training state in one flat float32 buffer laid out as `[parameters | Adam exp_avg | Adam
exp_avg_sq]`, each part in parameter-spec order, so the hot switch only ever copies contiguous
ranges (`Holding`). Both `worker_agent.runtime` and `worker_agent.hotswitch` import this module;
it imports neither.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Literal

import torch

ParamKind = Literal["replicated", "split0"]


class LayoutError(ValueError):
    """A layout is invalid for the model, the batch size, or the GPU count."""


@dataclass(frozen=True, order=True)
class Layout:
    """A 3-D parallel layout; ranks are ordered tp fastest, then dp, then pp (Megatron order)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.pp) < 1:
            raise LayoutError(f"every degree must be >= 1, got {self}")

    @property
    def world_size(self) -> int:
        """Number of workers (GPU slots) the layout needs."""
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> Coords:
        """The (pp, dp, tp) position of a rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside layout {self} of {self.world_size} workers")
        tp_idx = rank % self.tp
        dp_idx = (rank // self.tp) % self.dp
        pp_idx = rank // (self.tp * self.dp)
        return Coords(pp=pp_idx, dp=dp_idx, tp=tp_idx)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The rank at a (pp, dp, tp) position."""
        return (pp * self.dp + dp) * self.tp + tp

    def tp_groups(self) -> list[list[int]]:
        """Ranks of every tensor-parallel group, in a fixed order."""
        return [
            [self.rank_of(p, d, t) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Ranks of every data-parallel group, in a fixed order."""
        return [
            [self.rank_of(p, d, t) for d in range(self.dp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def __str__(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}"


@dataclass(frozen=True)
class Coords:
    """Position of one rank inside a layout."""

    pp: int
    dp: int
    tp: int


def split_blocks(n_blocks: int, pp: int) -> list[range]:
    """Contiguous, balanced block ranges per pipeline stage (earlier stages take the remainder)."""
    if pp > n_blocks:
        raise LayoutError(f"pp={pp} exceeds the model's {n_blocks} blocks")
    base, extra = divmod(n_blocks, pp)
    out: list[range] = []
    start = 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class ParamSpec:
    """One logical parameter: full shape, TP split, the pipeline unit it belongs to, its init."""

    name: str
    shape: tuple[int, ...]
    kind: ParamKind
    unit: int
    """Pipeline unit: -1 = embedding (first stage), n_blocks = head (last stage), else a block."""
    init_std: float = 0.02
    init_const: float | None = None
    also_units: tuple[int, ...] = ()
    """Further units that use this tensor (a tied weight, e.g. an LM head sharing the input
    embedding): every stage owning any of them holds a replica; gradients are summed."""
    transposed: bool = False
    """Stored as the transpose of the module's 2-D tensor (row-parallel weights, so that a TP
    shard is one contiguous range); the module sees a transposed view."""
    buffer: bool = False
    """A module buffer carried as state (e.g. BatchNorm running statistics): no gradient, no
    optimizer state, stored after the optimizer state in the flat buffer."""

    @property
    def units(self) -> tuple[int, ...]:
        """Every pipeline unit that uses this tensor."""
        return (self.unit, *self.also_units)

    @property
    def numel(self) -> int:
        """Elements of the full logical tensor."""
        return math.prod(self.shape)

    def init_full(self, seed: int) -> torch.Tensor:
        """The full initial tensor; the same on every worker and in every layout."""
        if self.init_const is not None:
            return torch.full(self.shape, self.init_const, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(self.name.encode()))
        return torch.randn(self.shape, generator=gen, dtype=torch.float32) * self.init_std


STATE_KINDS: tuple[str, ...] = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Holding:
    """Elements [start, end) of logical tensor `tensor`, stored at `offset` in a flat buffer."""

    tensor: str
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        """Elements held."""
        return self.end - self.start


@dataclass(frozen=True)
class ParamShard:
    """One parameter's local shard: logical range, local shape, offset in the parameter part."""

    spec: ParamSpec
    start: int
    end: int
    offset: int
    local_shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardMap:
    """Everything one rank holds in one layout.

    Flat buffer: `[params | one section per further state kind | buffers]`; the optimizer
    state kinds (AdamW's two moments, SGD's momentum, none) come from the job.
    """

    params: tuple[ParamShard, ...]
    n_param_elems: int
    kinds: tuple[str, ...] = STATE_KINDS
    buffers: tuple[ParamShard, ...] = ()
    """Buffers carried as state; their offsets count from the start of the buffer section."""
    n_buffer_elems: int = 0

    @property
    def n_state_elems(self) -> int:
        """Size of the flat state buffer (parameters, optimizer state, buffers)."""
        return self.n_param_elems * len(self.kinds) + self.n_buffer_elems

    @property
    def buffer_base(self) -> int:
        """Offset of the buffer section in the flat buffer."""
        return self.n_param_elems * len(self.kinds)

    def holdings(self) -> list[Holding]:
        """The state tensors this rank holds, named `kind/param`, with flat-buffer offsets."""
        out: list[Holding] = []
        for k, kind in enumerate(self.kinds):
            base = k * self.n_param_elems
            for ps in self.params:
                out.append(Holding(f"{kind}/{ps.spec.name}", ps.start, ps.end, base + ps.offset))
        for ps in self.buffers:
            out.append(
                Holding(f"buffer/{ps.spec.name}", ps.start, ps.end, self.buffer_base + ps.offset)
            )
        return out


def stage_units(n_blocks: int, layout: Layout, stage: int) -> set[int]:
    """Pipeline units (-1 embed, blocks, n_blocks head) that a stage owns."""
    units = set(split_blocks(n_blocks, layout.pp)[stage])
    if stage == 0:
        units.add(-1)
    if stage == layout.pp - 1:
        units.add(n_blocks)
    return units


def shard_map(
    specs: list[ParamSpec],
    n_blocks: int,
    layout: Layout,
    rank: int,
    kinds: tuple[str, ...] = STATE_KINDS,
) -> ShardMap:
    """The shards `rank` holds in `layout` (`kinds`: param first, then optimizer state)."""
    c = layout.coords(rank)
    units = stage_units(n_blocks, layout, c.pp)
    out: list[ParamShard] = []
    bufs: list[ParamShard] = []
    offset = 0
    buf_offset = 0
    for spec in specs:
        if not units.intersection(spec.units):
            continue
        if spec.buffer:
            bufs.append(ParamShard(spec, 0, spec.numel, buf_offset, spec.shape))
            buf_offset += spec.numel
            continue
        n = spec.numel
        if spec.kind == "split0" and layout.tp > 1:
            if spec.shape[0] % layout.tp:
                raise ValueError(f"{spec.name} dim 0 ({spec.shape[0]}) not divisible by tp")
            size = n // layout.tp
            start = c.tp * size
            local_shape = (spec.shape[0] // layout.tp, *spec.shape[1:])
        else:
            size, start, local_shape = n, 0, spec.shape
        out.append(ParamShard(spec, start, start + size, offset, local_shape))
        offset += size
    return ShardMap(tuple(out), offset, kinds, tuple(bufs), buf_offset)


def stages_of(spec: ParamSpec, n_blocks: int, layout: Layout) -> list[int]:
    """The pipeline stages that hold a replica of `spec` in `layout`."""
    return [
        s for s in range(layout.pp) if stage_units(n_blocks, layout, s).intersection(spec.units)
    ]
