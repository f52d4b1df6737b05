"""A Hugging Face causal language model trained on a text corpus this file generates.

Copy this directory, change the model or the data, and submit it:

    greenflow submit job.yaml --workdir examples/hf_causal_lm --follow

GreenFlow imports this module on the agents (never on the scheduler) and calls `job(**options)`
with the spec's `options`. The function returns a plain dict: the module needs nothing from
GreenFlow. The model is the stock `transformers.LlamaForCausalLM`; GreenFlow shards it by its
config's own tensor-parallel plan, splits pipeline stages at its decoder layers, and can
hot-switch it between layouts while it trains. When the job finishes, the agent exports it to a
directory that `LlamaForCausalLM.from_pretrained(...)` loads (see `generate.py`).
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

try:  # GreenFlow's scalar log (`greenflow logs JOB --scalars`); a no-op elsewhere
    from worker_agent.joblog import greenflow_log
except ImportError:

    def greenflow_log(**scalars: float) -> None:
        """Without GreenFlow installed: nothing to record."""


SUBJECTS = ["the cat", "a dog", "the robot", "my friend", "the teacher", "a bird", "the team"]
VERBS = ["sees", "likes", "builds", "finds", "paints", "follows", "carries"]
OBJECTS = ["a red ball", "the old house", "a small boat", "the green tree", "a bright lamp"]
ENDINGS = ["today.", "at night.", "in the park.", "with care.", "again and again."]

ALPHABET = sorted(set(" .abcdefghijklmnopqrstuvwxyz"))
"""Characters of the corpus; token id = index (a character-level tokenizer)."""


def make_corpus(sentences: int, seed: int = 0) -> str:
    """`sentences` random sentences of a tiny grammar (the same text for the same seed)."""
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
        for _ in range(sentences)
    )


def encode(text: str) -> torch.Tensor:
    """Token ids of `text`."""
    return torch.tensor([ALPHABET.index(ch) for ch in text], dtype=torch.long)


def decode(ids: list[int]) -> str:
    """Text of token ids."""
    return "".join(ALPHABET[i] for i in ids)


class TextWindows(Dataset[dict[str, torch.Tensor]]):
    """Overlapping windows of `seq_len` tokens over the corpus (a map-style dataset)."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.ids = encode(text)
        self.seq_len = seq_len
        self.stride = max(1, seq_len // 2)

    def __len__(self) -> int:
        return (len(self.ids) - self.seq_len) // self.stride

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        window = self.ids[idx * self.stride : idx * self.stride + self.seq_len]
        # The model shifts labels itself: labels = inputs.
        return {"input_ids": window, "labels": window.clone()}


def model_config(hidden_size: int, layers: int, heads: int, seq_len: int) -> LlamaConfig:
    """A small LLaMA over the character vocabulary."""
    return LlamaConfig(
        vocab_size=len(ALPHABET),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss (it shifts the labels), also logged with the tokens it covered."""
    out = model(**batch)
    greenflow_log(loss=float(out.loss), tokens=int(batch["input_ids"].numel()))
    return out.loss


def job(
    hidden_size: int = 64,
    layers: int = 4,
    heads: int = 4,
    seq_len: int = 32,
    sentences: int = 2000,
    lr: float = 3e-3,
    total_steps: int = 1000,
) -> dict[str, object]:
    """The training job: model factory, dataset, optimizer, LR schedule, clipping."""
    config = model_config(hidden_size, layers, heads, seq_len)
    dataset = TextWindows(make_corpus(sentences), seq_len)
    # Printed by every worker process: `greenflow logs JOB` shows it.
    print(f"corpus: {len(dataset.ids)} characters, {len(dataset)} windows of {seq_len}")
    return {
        "model": lambda: LlamaForCausalLM(config),
        "dataset": dataset,
        "loss": loss,  # without one: model(**batch).loss        "optimizer": {"name": "adamw", "lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.01},
        "lr_schedule": {"warmup_steps": 20, "total_steps": total_steps, "min_lr_ratio": 0.1},
        "grad_clip_norm": 1.0,
        "precision": "fp32",
    }
