"""Shard geometry: which contiguous range of each logical tensor a rank holds, and where.

A worker keeps its whole training state in one flat float32 buffer laid out as
`[parameters | Adam exp_avg | Adam exp_avg_sq]`, each part in parameter-spec order. Every entry
is a contiguous slice of a logical tensor's flattened elements, so the hot switch only ever
copies contiguous ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker_agent.runtime.job import ParamSpec
from worker_agent.runtime.layout import Layout, split_blocks

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
    """Everything one rank holds in one layout."""

    params: tuple[ParamShard, ...]
    n_param_elems: int

    @property
    def n_state_elems(self) -> int:
        """Size of the flat state buffer (parameters plus two Adam moments)."""
        return self.n_param_elems * len(STATE_KINDS)

    def holdings(self) -> list[Holding]:
        """The state tensors this rank holds, named `kind/param`, with flat-buffer offsets."""
        out: list[Holding] = []
        for k, kind in enumerate(STATE_KINDS):
            base = k * self.n_param_elems
            for ps in self.params:
                out.append(Holding(f"{kind}/{ps.spec.name}", ps.start, ps.end, base + ps.offset))
        return out


def stage_units(n_blocks: int, layout: Layout, stage: int) -> set[int]:
    """Pipeline units (-1 embed, blocks, n_blocks head) that a stage owns."""
    units = set(split_blocks(n_blocks, layout.pp)[stage])
    if stage == 0:
        units.add(-1)
    if stage == layout.pp - 1:
        units.add(n_blocks)
    return units


def shard_map(specs: list[ParamSpec], n_blocks: int, layout: Layout, rank: int) -> ShardMap:
    """The shards `rank` holds in `layout`."""
    c = layout.coords(rank)
    units = stage_units(n_blocks, layout, c.pp)
    out: list[ParamShard] = []
    offset = 0
    for spec in specs:
        if spec.unit not in units:
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
    return ShardMap(tuple(out), offset)
