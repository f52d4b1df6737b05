"""What a user's job module returns: a job definition around their own `torch.nn.Module`.

A job module has one function that returns a `JobDefinition` (or a plain dict with the same
keys, so the module need not import GreenFlow at all):

    def job(**options):
        return {
            "model": lambda: transformers.GPT2LMHeadModel(GPT2Config(n_layer=2)),
            "dataset": MyDataset(),              # map-style torch Dataset
            "loss": lambda model, batch: model(**batch).loss,
            "optimizer": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.1},
            "lr_schedule": {"warmup_steps": 100, "total_steps": 10_000},
            "global_batch_size": 32, "micro_batch_size": 4,
        }

The model is not modified by the user and not re-implemented by GreenFlow: no base class, no
functional rewrite. The runtime builds it, shards its parameters by layout, and drives the
standard module forward. The loader only needs the job's directory on `sys.path`.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, model_validator
from torch import nn

from worker_agent.runtime.errors import JobSpecError

TpStyle = Literal["colwise", "rowwise", "replicated"]
Precision = Literal["fp32", "bf16"]


class OptimizerConfig(BaseModel):
    """The optimizer (torch.optim.AdamW or SGD) and its hyper-parameters; fixed across layouts."""

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    """SGD only."""
    nesterov: bool = False
    """SGD only (needs momentum > 0)."""

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """The per-element state tensors this optimizer keeps, the parameter first."""
        if self.name == "adamw":
            return ("param", "exp_avg", "exp_avg_sq")
        return ("param", "momentum_buffer") if self.momentum > 0 else ("param",)

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        if self.nesterov and (self.name != "sgd" or self.momentum <= 0):
            raise ValueError("nesterov needs optimizer sgd with momentum > 0")
        return self


class LRSchedule(BaseModel):
    """Linear warm-up, then cosine decay to `min_lr_ratio` x lr at `total_steps` (or constant)."""

    kind: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0)
    total_steps: int | None = Field(default=None, ge=1)
    """None: constant after the warm-up."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)

    def factor(self, step: int) -> float:
        """LR multiplier for optimizer step `step` (0-based), as torch's LambdaLR would give it."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant" or self.total_steps is None:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


@dataclass
class JobDefinition:
    """A user's training job: their model, data, loss, optimizer and parallelism hints."""

    model: Callable[[], nn.Module]
    """Builds the model (random init or weights of the user's own); called with a fixed seed."""
    dataset: Any
    """A map-style `torch.utils.data.Dataset` (or a callable returning one)."""
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None
    """(model, micro-batch) -> mean loss of the micro-batch; default `model(**batch).loss`."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    grad_clip_norm: float | None = None
    """Clip the global gradient norm (all shards) to this, as clip_grad_norm_ would."""
    precision: Precision = "fp32"
    """fp32, or bf16 autocast (parameters and optimizer state stay fp32)."""
    global_batch_size: int = 8
    micro_batch_size: int = 1
    tp_plan: Mapping[str, TpStyle] | None = None
    """Module-name patterns (`*` = one name part) -> colwise / rowwise / replicated, as
    torch.distributed.tensor.parallel's styles; None: the model config's `base_model_tp_plan`
    (Hugging Face) when it has one, else no tensor parallelism."""
    blocks: str | None = None
    """Dotted path of the block list pipeline stages split at (a ModuleList); None: the Hugging
    Face `base_model_pp_plan`'s, else the largest ModuleList."""
    collate: Callable[[list[Any]], Any] | None = None
    """Default `torch.utils.data.default_collate`."""
    shuffle: bool = True
    """Sample order: a fresh seeded permutation per epoch (else in index order)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, Mapping):
            self.optimizer = OptimizerConfig.model_validate(self.optimizer)
        if isinstance(self.lr_schedule, Mapping):
            self.lr_schedule = LRSchedule.model_validate(self.lr_schedule)
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise JobSpecError("global_batch_size and micro_batch_size must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise JobSpecError(
                f"global_batch_size {self.global_batch_size} must be a multiple of "
                f"micro_batch_size {self.micro_batch_size}"
            )
        if self.precision not in ("fp32", "bf16"):
            raise JobSpecError(f"precision must be fp32 or bf16, got {self.precision!r}")
        for pattern, style in (self.tp_plan or {}).items():
            if style not in ("colwise", "rowwise", "replicated"):
                raise JobSpecError(
                    f"tp_plan[{pattern!r}] = {style!r}: use colwise, rowwise or replicated"
                )
        if not callable(self.model):
            raise JobSpecError("model must be a callable returning a torch.nn.Module")


def as_definition(value: Any, where: str) -> JobDefinition:
    """A JobDefinition from what a job function returned (the object itself or a dict)."""
    if isinstance(value, JobDefinition):
        return value
    if isinstance(value, Mapping):
        try:
            return JobDefinition(**value)
        except TypeError as exc:
            raise JobSpecError(f"{where} returned a dict with bad keys: {exc}") from exc
    raise JobSpecError(
        f"{where} returned {type(value).__name__}; return a JobDefinition or a dict of its fields"
    )


def load_definition(
    entrypoint: str, options: Mapping[str, Any] | None = None, workdir: str | None = None
) -> JobDefinition:
    """Import `package.module:function` (with `workdir` first on sys.path) and call it."""
    module_name, sep, attr = entrypoint.partition(":")
    if not sep or not module_name or not attr:
        raise JobSpecError(f"entrypoint {entrypoint!r}: use 'package.module:function'")
    if workdir is not None and workdir not in sys.path:
        sys.path.insert(0, workdir)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure in user code is the job's, reported with its cause
        raise JobSpecError(
            f"cannot import job module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise JobSpecError(f"job module {module_name!r} has no function {attr!r}")
    try:
        value = fn(**dict(options or {}))
    except JobSpecError:
        raise
    except Exception as exc:
        raise JobSpecError(f"{entrypoint} raised {type(exc).__name__}: {exc}") from exc
    return as_definition(value, entrypoint)
