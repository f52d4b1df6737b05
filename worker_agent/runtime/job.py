"""The public job API: what a model must expose so the runtime can shard and hot-switch it.

A job describes its parameters as *logical* tensors (full shapes) and says which ones are split
across tensor-parallel ranks. Every split tensor is split along dim 0, so each rank's shard is one
contiguous range of the flattened logical tensor; row-parallel weights are therefore stored
transposed (`[in, out]`). That choice makes every shard and every transfer piece a contiguous
slice, which is what keeps packing and unpacking during a hot switch to plain `copy_` calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from worker_agent.sharding import ParamSpec

Batch = dict[str, torch.Tensor]


class _CopyToTP(torch.autograd.Function):
    """Megatron's `f`: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's `g`: all-reduce forward, identity backward (so gradients are not double-counted)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


@dataclass
class TensorParallel:
    """The tensor-parallel context a block sees: its degree, its index and the two Megatron ops.

    Hand-written instead of DTensor: on gloo DTensor reshards fall back to all-gather, and the
    hot switch needs to own the shard geometry (DTensor cannot move shards to another mesh).
    """

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    def copy_in(self, x: torch.Tensor) -> torch.Tensor:
        """Enter a column-parallel region (identity forward, all-reduce backward)."""
        if self.size == 1:
            return x
        return _CopyToTP.apply(x, self.group)  # type: ignore[no-any-return]

    def reduce_out(self, x: torch.Tensor) -> torch.Tensor:
        """Leave a row-parallel region (all-reduce forward, identity backward)."""
        if self.size == 1:
            return x
        return _ReduceFromTP.apply(x, self.group)  # type: ignore[no-any-return]


@runtime_checkable
class TrainingJob(Protocol):
    """A model, a data stream and a loss, written against local parameter shards.

    `params` maps a logical name to this worker's shard: the full tensor for replicated
    parameters, rows `[r*n/tp, (r+1)*n/tp)` of dim 0 for `split0` ones. The optimizer (AdamW,
    hyper-parameters from the job spec) is applied by the runtime.
    """

    def param_specs(self) -> list[ParamSpec]:
        """Every logical parameter, in a fixed order."""
        ...

    def n_blocks(self) -> int:
        """Number of pipeline-splittable blocks."""
        ...

    def tp_divisor(self) -> int:
        """Every tensor-parallel degree must divide this."""
        ...

    def batch(self, step: int, global_batch_size: int) -> Batch:
        """The global batch of a step (deterministic in `step`); leading dim is the sample."""
        ...

    def embed(self, params: Mapping[str, torch.Tensor], batch: Batch) -> torch.Tensor:
        """Input of the first block."""
        ...

    def block(
        self, index: int, params: Mapping[str, torch.Tensor], h: torch.Tensor, tp: TensorParallel
    ) -> torch.Tensor:
        """One block; output must be replicated across TP ranks."""
        ...

    def head_loss(
        self, params: Mapping[str, torch.Tensor], h: torch.Tensor, batch: Batch
    ) -> torch.Tensor:
        """Sum over the samples of the per-sample loss (the runtime divides by the global batch)."""
        ...
