"""Built-in jobs: a GPT-style decoder, a BERT-style encoder and an MLP, on seeded synthetic data."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field, model_validator

from worker_agent.runtime.errors import JobSpecError
from worker_agent.runtime.job import Batch, TensorParallel, TrainingJob
from worker_agent.runtime.layout import ModelShape
from worker_agent.sharding import ParamSpec


class OptimizerSpec(BaseModel):
    """AdamW hyper-parameters; fixed across layouts."""

    lr: float = Field(default=1e-3, gt=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


class JobSpec(BaseModel):
    """What a job spec names: a model job (built-in `model` or a user's `entrypoint`), or one of
    the functional presets; its batch and seed (and the presets' size and optimizer)."""

    preset: Literal["gpt", "bert", "mlp"] | None = "gpt"
    """A functional preset (runtime/presets.py); ignored when `model` or `entrypoint` is set."""
    model: str | None = None
    """A built-in nn.Module job (`worker_agent.runtime.models.BUILTIN`, e.g. `gpt2-124m`)."""
    entrypoint: str | None = None
    """A user's job module, `package.module:function` returning a `JobDefinition` (or a dict of
    its fields), called with `options`; imported only in the job's worker processes."""
    workdir: str | None = None
    """Directory put first on the workers' `sys.path` before importing `entrypoint`."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the model builder / job function; `optimizer`, `lr_schedule`,
    `grad_clip_norm`, `precision`, `tp_plan` override the definition's own."""
    n_layers: int = Field(default=2, ge=1)
    d_model: int = Field(default=32, ge=1)
    n_heads: int = Field(default=4, ge=1)
    ffn_mult: int = Field(default=4, ge=1)
    vocab_size: int = Field(default=64, ge=2)
    seq_len: int = Field(default=16, ge=1)
    n_features: int = Field(default=16, ge=1)
    n_classes: int = Field(default=8, ge=2)
    global_batch_size: int = Field(default=8, ge=1)
    micro_batch_size: int = Field(default=2, ge=1)
    seed: int = 0
    optimizer: OptimizerSpec = Field(default_factory=lambda: OptimizerSpec())

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if self.preset is None and self.entrypoint is None and self.model is None:
            raise ValueError("set one of preset, model or entrypoint")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")
        return self


def _block_specs(i: int, d: int, ffn: int) -> list[ParamSpec]:
    """Pre-LN transformer block; q/k/v/fc1 column-parallel, o/fc2 row-parallel (stored [in, out])."""
    std_out = 0.02 / math.sqrt(2.0)
    p = f"blocks.{i}."
    return [
        ParamSpec(p + "ln1.w", (d,), "replicated", i, init_const=1.0),
        ParamSpec(p + "ln1.b", (d,), "replicated", i, init_const=0.0),
        ParamSpec(p + "q.w", (d, d), "split0", i),
        ParamSpec(p + "q.b", (d,), "split0", i, init_const=0.0),
        ParamSpec(p + "k.w", (d, d), "split0", i),
        ParamSpec(p + "k.b", (d,), "split0", i, init_const=0.0),
        ParamSpec(p + "v.w", (d, d), "split0", i),
        ParamSpec(p + "v.b", (d,), "split0", i, init_const=0.0),
        ParamSpec(p + "o.w", (d, d), "split0", i, init_std=std_out),
        ParamSpec(p + "o.b", (d,), "replicated", i, init_const=0.0),
        ParamSpec(p + "ln2.w", (d,), "replicated", i, init_const=1.0),
        ParamSpec(p + "ln2.b", (d,), "replicated", i, init_const=0.0),
        ParamSpec(p + "fc1.w", (ffn, d), "split0", i),
        ParamSpec(p + "fc1.b", (ffn,), "split0", i, init_const=0.0),
        ParamSpec(p + "fc2.w", (ffn, d), "split0", i, init_std=std_out),
        ParamSpec(p + "fc2.b", (d,), "replicated", i, init_const=0.0),
    ]


class _Transformer:
    """Shared code of the GPT and BERT presets."""

    causal = True

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.d = spec.d_model
        self.ffn = spec.d_model * spec.ffn_mult
        self.head_dim = spec.d_model // spec.n_heads

    def n_blocks(self) -> int:
        return self.spec.n_layers

    def tp_divisor(self) -> int:
        return math.gcd(self.spec.n_heads, self.ffn)

    def param_specs(self) -> list[ParamSpec]:
        s = self.spec
        out = [
            ParamSpec("embed.tok", (s.vocab_size, self.d), "replicated", -1),
            ParamSpec("embed.pos", (s.seq_len, self.d), "replicated", -1),
        ]
        for i in range(s.n_layers):
            out += _block_specs(i, self.d, self.ffn)
        n = s.n_layers
        out += [
            ParamSpec("head.ln.w", (self.d,), "replicated", n, init_const=1.0),
            ParamSpec("head.ln.b", (self.d,), "replicated", n, init_const=0.0),
            ParamSpec("head.out", (s.vocab_size, self.d), "replicated", n),
        ]
        return out

    def embed(self, params: Mapping[str, torch.Tensor], batch: Batch) -> torch.Tensor:
        tokens = batch["inputs"]
        return params["embed.tok"][tokens] + params["embed.pos"][: tokens.shape[1]]

    def block(
        self, index: int, params: Mapping[str, torch.Tensor], h: torch.Tensor, tp: TensorParallel
    ) -> torch.Tensor:
        p = f"blocks.{index}."
        b, t, _ = h.shape
        x = tp.copy_in(F.layer_norm(h, (self.d,), params[p + "ln1.w"], params[p + "ln1.b"]))
        local_heads = self.spec.n_heads // tp.size

        def heads(name: str) -> torch.Tensor:
            y = F.linear(x, params[p + name + ".w"], params[p + name + ".b"])
            return y.view(b, t, local_heads, self.head_dim).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            heads("q"), heads("k"), heads("v"), is_causal=self.causal
        )
        att = att.transpose(1, 2).reshape(b, t, local_heads * self.head_dim)
        h = h + tp.reduce_out(att @ params[p + "o.w"]) + params[p + "o.b"]
        x = tp.copy_in(F.layer_norm(h, (self.d,), params[p + "ln2.w"], params[p + "ln2.b"]))
        y = F.gelu(F.linear(x, params[p + "fc1.w"], params[p + "fc1.b"]))
        return h + tp.reduce_out(y @ params[p + "fc2.w"]) + params[p + "fc2.b"]

    def _logits(self, params: Mapping[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(h, (self.d,), params["head.ln.w"], params["head.ln.b"])
        return F.linear(h, params["head.out"])

    def _token_stream(self, step: int, n: int) -> torch.Tensor:
        """Noisy affine sequences x[t+1] = (a*x[t] + c) mod V: learnable, seeded by (seed, step)."""
        s = self.spec
        gen = torch.Generator().manual_seed(s.seed * 7_919 + step)
        start = torch.randint(0, s.vocab_size, (n, 1), generator=gen)
        mult = torch.randint(1, 4, (n, 1), generator=gen)
        steps = torch.arange(s.seq_len + 1).unsqueeze(0)
        seq = (start + mult * steps) % s.vocab_size
        noise = torch.rand(seq.shape, generator=gen) < 0.1
        return torch.where(noise, torch.randint(0, s.vocab_size, seq.shape, generator=gen), seq)


class GPTJob(_Transformer):
    """GPT-style causal decoder; next-token loss."""

    def batch(self, step: int, global_batch_size: int) -> Batch:
        seq = self._token_stream(step, global_batch_size)
        return {"inputs": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()}

    def head_loss(
        self, params: Mapping[str, torch.Tensor], h: torch.Tensor, batch: Batch
    ) -> torch.Tensor:
        logits = self._logits(params, h)
        per_tok = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1), reduction="none"
        )
        return per_tok.view(h.shape[0], -1).mean(dim=1).sum()


class BERTJob(_Transformer):
    """BERT-style bidirectional encoder; masked-token loss (15 % of positions masked)."""

    causal = False

    def batch(self, step: int, global_batch_size: int) -> Batch:
        seq = self._token_stream(step, global_batch_size)[:, :-1]
        gen = torch.Generator().manual_seed(self.spec.seed * 104_729 + step)
        mask = torch.rand(seq.shape, generator=gen) < 0.15
        mask[:, 0] = True  # at least one masked position per sample
        mask_id = self.spec.vocab_size - 1
        return {
            "inputs": torch.where(mask, torch.full_like(seq, mask_id), seq),
            "targets": seq.contiguous(),
            "mask": mask.float(),
        }

    def head_loss(
        self, params: Mapping[str, torch.Tensor], h: torch.Tensor, batch: Batch
    ) -> torch.Tensor:
        logits = self._logits(params, h)
        per_tok = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1), reduction="none"
        ).view(h.shape[0], -1)
        mask = batch["mask"]
        return ((per_tok * mask).sum(dim=1) / mask.sum(dim=1)).sum()


class MLPJob:
    """Residual MLP classifier on synthetic features labelled by a fixed random teacher."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.d = spec.d_model
        self.ffn = spec.d_model * spec.ffn_mult

    def n_blocks(self) -> int:
        return self.spec.n_layers

    def tp_divisor(self) -> int:
        return self.ffn

    def param_specs(self) -> list[ParamSpec]:
        s = self.spec
        out = [
            ParamSpec("embed.w", (self.d, s.n_features), "replicated", -1, s.n_features**-0.5),
            ParamSpec("embed.b", (self.d,), "replicated", -1, init_const=0.0),
        ]
        for i in range(s.n_layers):
            p = f"blocks.{i}."
            out += [
                ParamSpec(p + "ln.w", (self.d,), "replicated", i, init_const=1.0),
                ParamSpec(p + "ln.b", (self.d,), "replicated", i, init_const=0.0),
                ParamSpec(p + "fc1.w", (self.ffn, self.d), "split0", i, self.d**-0.5),
                ParamSpec(p + "fc1.b", (self.ffn,), "split0", i, init_const=0.0),
                ParamSpec(p + "fc2.w", (self.ffn, self.d), "split0", i, 0.5 * self.ffn**-0.5),
                ParamSpec(p + "fc2.b", (self.d,), "replicated", i, init_const=0.0),
            ]
        out.append(
            ParamSpec("head.w", (s.n_classes, self.d), "replicated", s.n_layers, self.d**-0.5)
        )
        return out

    def batch(self, step: int, global_batch_size: int) -> Batch:
        s = self.spec
        teacher = torch.Generator().manual_seed(s.seed * 31 + 1)
        w_teacher = torch.randn(s.n_classes, s.n_features, generator=teacher)
        gen = torch.Generator().manual_seed(s.seed * 7_919 + step)
        x = torch.randn(global_batch_size, s.n_features, generator=gen)
        return {"inputs": x, "targets": (x @ w_teacher.T).argmax(dim=1)}

    def embed(self, params: Mapping[str, torch.Tensor], batch: Batch) -> torch.Tensor:
        return F.linear(batch["inputs"], params["embed.w"], params["embed.b"])

    def block(
        self, index: int, params: Mapping[str, torch.Tensor], h: torch.Tensor, tp: TensorParallel
    ) -> torch.Tensor:
        p = f"blocks.{index}."
        x = tp.copy_in(F.layer_norm(h, (self.d,), params[p + "ln.w"], params[p + "ln.b"]))
        y = F.gelu(F.linear(x, params[p + "fc1.w"], params[p + "fc1.b"]))
        return h + tp.reduce_out(y @ params[p + "fc2.w"]) + params[p + "fc2.b"]

    def head_loss(
        self, params: Mapping[str, torch.Tensor], h: torch.Tensor, batch: Batch
    ) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, params["head.w"]), batch["targets"], reduction="sum")


def is_module_job(spec: JobSpec) -> bool:
    """Whether the spec names an nn.Module job (built-in model or user job module)."""
    return spec.model is not None or spec.entrypoint is not None


def build_job(spec: JobSpec) -> TrainingJob:
    """The functional preset a spec names (module jobs are built in their workers only)."""
    if is_module_job(spec):
        raise JobSpecError(
            f"{spec.model or spec.entrypoint!r} is an nn.Module job: its workers build it"
        )
    if spec.preset == "gpt":
        return GPTJob(spec)
    if spec.preset == "bert":
        return BERTJob(spec)
    return MLPJob(spec)


def model_shape(job: TrainingJob, spec: JobSpec) -> ModelShape:
    """Sizes the layout chooser needs, derived from a job's parameter specs."""
    n_params = sum(p.numel for p in job.param_specs())
    width = spec.d_model
    tokens = spec.seq_len if spec.preset in ("gpt", "bert") else 1
    return ModelShape(
        n_params=n_params,
        n_blocks=job.n_blocks(),
        tp_divisor=job.tp_divisor(),
        activation_elems_per_sample=tokens * width,
        flops_per_sample=6.0 * n_params * tokens,
        global_batch_size=spec.global_batch_size,
        micro_batch_size=spec.micro_batch_size,
    )
