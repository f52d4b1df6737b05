"""Built-in model jobs: real architectures (Hugging Face transformers classes) at real sizes, tiny
variants of the same classes for tests, and seeded synthetic datasets (no downloads).

| name | model | parameters |
|---|---|---|
| `gpt2-124m` / `gpt2-tiny` | `GPT2LMHeadModel` | 124.4 M / ~0.2 M |
| `llama-350m` / `llama-tiny` | `LlamaForCausalLM` (GQA in the tiny one) | ~349 M / ~0.2 M |
| `bert-base` / `bert-tiny` | `BertForMaskedLM` | ~110 M / ~0.2 M |
| `resnet50` / `resnet-tiny` | `ResNetForImageClassification` (torchvision's ResNet-50 shape) | 23.5 M / tiny |

Weights are random (seeded); each is a `JobDefinition` a user's job module could have written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from worker_agent.runtime.errors import JobSpecError
from worker_agent.runtime.jobdef import JobDefinition, OptimizerConfig, TpStyle, load_definition
from worker_agent.runtime.presets import JobSpec

GPT2_TP_PLAN: dict[str, TpStyle] = {"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}
"""GPT-2's attention is one fused q/k/v Conv1D, which colwise/rowwise cannot split by head: its
MLP is tensor-parallel, its attention replicated on the TP ranks."""

BERT_TP_PLAN: dict[str, TpStyle] = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}
"""BertConfig declares no plan; this is the Megatron split of its blocks in torch's styles."""


class TokenSequences(Dataset[dict[str, torch.Tensor]]):
    """Noisy affine token sequences x[t+1] = (a x[t] + c) mod V: learnable, seeded per index."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        self.n, self.seq_len, self.vocab, self.seed = n, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.n

    def tokens(self, idx: int) -> torch.Tensor:
        """The sequence of sample `idx`."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        start = int(torch.randint(0, self.vocab, (1,), generator=gen))
        mult = int(torch.randint(1, 4, (1,), generator=gen))
        seq = (start + mult * torch.arange(self.seq_len)) % self.vocab
        noise = torch.rand(self.seq_len, generator=gen) < 0.1
        return torch.where(noise, torch.randint(0, self.vocab, (self.seq_len,), generator=gen), seq)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        ids = self.tokens(idx)
        return {"input_ids": ids, "labels": ids.clone()}


class MaskedTokens(TokenSequences):
    """The same sequences with 15 % of positions masked (BERT's masked-token objective)."""

    def __init__(self, n: int, seq_len: int, vocab: int, mask_id: int, seed: int = 0) -> None:
        super().__init__(n, seq_len, vocab, seed)
        self.mask_id = mask_id

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        ids = self.tokens(idx)
        gen = torch.Generator().manual_seed(self.seed * 7_919 + idx)
        mask = torch.rand(self.seq_len, generator=gen) < 0.15
        mask[0] = True  # at least one masked position per sample
        return {
            "input_ids": torch.where(mask, torch.full_like(ids, self.mask_id), ids),
            "attention_mask": torch.ones_like(ids),
            "labels": torch.where(mask, ids, torch.full_like(ids, -100)),
        }


class TeacherImages(Dataset[dict[str, torch.Tensor]]):
    """Random images labelled by a fixed random linear teacher on 4x4-pooled pixels."""

    def __init__(self, n: int, size: int, classes: int, seed: int = 0) -> None:
        self.n, self.size, self.classes, self.seed = n, size, classes, seed
        gen = torch.Generator().manual_seed(seed * 31 + 1)
        self.teacher = torch.randn(classes, 3 * 16, generator=gen)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        img = torch.randn(3, self.size, self.size, generator=gen)
        pooled = torch.nn.functional.adaptive_avg_pool2d(img, 4).reshape(-1)
        label = int((self.teacher @ pooled).argmax())
        return {"pixel_values": img, "labels": torch.tensor(label)}


def _gpt2(size: str, seq_len: int, samples: int, layers: int = 4) -> JobDefinition:
    from transformers import GPT2Config, GPT2LMHeadModel

    if size == "124m":
        config = GPT2Config()
    else:
        config = GPT2Config(
            n_embd=64,
            n_layer=4,
            n_head=4,
            vocab_size=128,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        )
    return JobDefinition(
        model=lambda: GPT2LMHeadModel(config),
        dataset=TokenSequences(samples, seq_len, config.vocab_size),
        tp_plan=GPT2_TP_PLAN,
    )


def _llama(size: str, seq_len: int, samples: int, layers: int = 4) -> JobDefinition:
    from transformers import LlamaConfig, LlamaForCausalLM

    if size == "350m":
        config = LlamaConfig(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=22,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=32000,
            max_position_embeddings=1024,
        )
    else:
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=64,
        )
    # tp_plan None: the config's own base_model_tp_plan (q/k/v/gate/up colwise, o/down rowwise).
    return JobDefinition(
        model=lambda: LlamaForCausalLM(config),
        dataset=TokenSequences(samples, seq_len, config.vocab_size),
    )


def _bert(size: str, seq_len: int, samples: int, layers: int = 4) -> JobDefinition:
    from transformers import BertConfig, BertForMaskedLM

    # Attention-probability dropout acts on TP-split heads, whose masks cannot match the unsplit
    # run's; hidden dropout (on replicated activations) stays at BERT's 0.1.
    if size == "base":
        config = BertConfig(attention_probs_dropout_prob=0.0)
    else:
        config = BertConfig(
            hidden_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=128,
            max_position_embeddings=64,
            attention_probs_dropout_prob=0.0,
        )
    return JobDefinition(
        model=lambda: BertForMaskedLM(config),
        dataset=MaskedTokens(samples, seq_len, config.vocab_size, mask_id=config.vocab_size - 1),
        tp_plan=BERT_TP_PLAN,
    )


def _resnet(size: str, image_size: int, samples: int) -> JobDefinition:
    from transformers import ResNetConfig, ResNetForImageClassification

    classes = 10
    if size == "50":
        config = ResNetConfig(
            depths=[3, 4, 6, 3],
            layer_type="bottleneck",
            hidden_sizes=[256, 512, 1024, 2048],
            num_labels=classes,  # type: ignore[call-arg]  # a PretrainedConfig kwarg
        )
    else:
        config = ResNetConfig(
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=classes,  # type: ignore[call-arg]
        )
    return JobDefinition(
        model=lambda: ResNetForImageClassification(config),
        dataset=TeacherImages(samples, image_size, classes),
        optimizer=OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4),
    )


BUILTIN: dict[str, Callable[..., JobDefinition]] = {
    "gpt2-124m": lambda seq_len=64, samples=4096: _gpt2("124m", seq_len, samples),
    "gpt2-tiny": lambda seq_len=16, samples=512, layers=4: _gpt2("tiny", seq_len, samples, layers),
    "llama-350m": lambda seq_len=64, samples=4096: _llama("350m", seq_len, samples),
    "llama-tiny": lambda seq_len=16, samples=512, layers=4: _llama(
        "tiny", seq_len, samples, layers
    ),
    "bert-base": lambda seq_len=64, samples=4096: _bert("base", seq_len, samples),
    "bert-tiny": lambda seq_len=16, samples=512, layers=4: _bert("tiny", seq_len, samples, layers),
    "resnet50": lambda image_size=64, samples=4096: _resnet("50", image_size, samples),
    "resnet-tiny": lambda image_size=16, samples=512: _resnet("tiny", image_size, samples),
}


def definition_for(spec: JobSpec) -> JobDefinition:
    """The job a module-job spec names (built-in model or user job module), with the spec's
    global batch, micro-batch and seed (the scheduler's contract) applied."""
    options: dict[str, Any] = dict(spec.options)
    overrides: dict[str, Any] = {}
    for key in ("optimizer", "lr_schedule", "grad_clip_norm", "precision", "tp_plan"):
        if key in options:
            overrides[key] = options.pop(key)
    if spec.entrypoint is not None:
        defn = load_definition(spec.entrypoint, options, spec.workdir)
    elif spec.model in BUILTIN:
        try:
            defn = BUILTIN[spec.model](**options)
        except TypeError as exc:
            raise JobSpecError(f"model {spec.model!r}: bad options {options}: {exc}") from exc
    else:
        raise JobSpecError(f"unknown model {spec.model!r}; built-in: {', '.join(BUILTIN)}")
    fields = {
        **{k: getattr(defn, k) for k in defn.__dataclass_fields__},
        **overrides,
        "global_batch_size": spec.global_batch_size,
        "micro_batch_size": spec.micro_batch_size,
        "seed": spec.seed,
    }
    return JobDefinition(**fields)
