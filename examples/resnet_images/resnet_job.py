"""A ResNet image classifier trained on images this file generates (coloured shapes).

    greenflow submit job.yaml --workdir examples/resnet_images --follow

`impl: torchvision` trains `torchvision.models.resnet18`; `impl: transformers` trains the same
architecture family as `transformers.ResNetForImageClassification` (whose export
`from_pretrained` loads); `auto` (the default) takes torchvision where it imports (its registry
build needs the matching CUDA torch) and transformers elsewhere. Either way the model is the
library's own `torch.nn.Module`, unmodified: GreenFlow trains it data-parallel (with BatchNorm
statistics kept in step across ranks) or in pipeline stages, and hot-switches between them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

CLASSES = ("disc", "square", "stripes", "ring")


class Shapes(Dataset[dict[str, torch.Tensor]]):
    """`n` images of one of CLASSES, random colour, position, size and noise (seeded by index)."""

    def __init__(self, n: int, size: int, seed: int = 0) -> None:
        self.n, self.size, self.seed = n, size, seed
        axis = torch.arange(size, dtype=torch.float32)
        self.yy, self.xx = torch.meshgrid(axis, axis, indexing="ij")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        label = idx % len(CLASSES)
        s = self.size
        cx, cy = (torch.rand(2, generator=gen) * 0.5 + 0.25) * s
        radius = float(torch.rand(1, generator=gen)) * s / 6 + s / 6
        dist = torch.sqrt((self.xx - cx) ** 2 + (self.yy - cy) ** 2)
        if CLASSES[label] == "disc":
            mask = dist < radius
        elif CLASSES[label] == "square":
            mask = ((self.xx - cx).abs() < radius) & ((self.yy - cy).abs() < radius)
        elif CLASSES[label] == "stripes":
            period = max(2.0, radius / 2)
            mask = torch.sin(2 * math.pi * self.xx / period) > 0
        else:
            mask = (dist < radius) & (dist > radius * 0.6)
        colour = torch.rand(3, 1, 1, generator=gen) * 0.8 + 0.2
        background = torch.rand(3, 1, 1, generator=gen) * 0.2
        img = torch.where(mask, colour, background) + 0.05 * torch.randn(3, s, s, generator=gen)
        return {"pixel_values": img, "labels": torch.tensor(label)}


def _torchvision_model() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=len(CLASSES))


def _transformers_model(width: int) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(  # type: ignore[call-arg]  # the label fields are PretrainedConfig's
        embedding_size=width,
        hidden_sizes=[width, 2 * width, 4 * width, 8 * width],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        num_labels=len(CLASSES),
        id2label=dict(enumerate(CLASSES)),
        label2id={c: i for i, c in enumerate(CLASSES)},
    )
    return ResNetForImageClassification(config)


def _has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # an ImportError, or a RuntimeError from a build for another torch
        return False
    return True


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the model's logits (torchvision returns a tensor, transformers an output)."""
    out = model(batch["pixel_values"])
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits, batch["labels"])


def job(
    impl: str = "auto",
    image_size: int = 32,
    samples: int = 2048,
    width: int = 16,
    lr: float = 0.05,
    total_steps: int = 500,
) -> dict[str, object]:
    """The training job: model factory, dataset, SGD with momentum, warm-up + cosine."""
    if impl == "auto":
        impl = "torchvision" if _has_torchvision() else "transformers"
    if impl not in ("torchvision", "transformers"):
        raise ValueError(f"impl must be auto, torchvision or transformers, got {impl!r}")
    definition: dict[str, object] = {
        "model": _torchvision_model
        if impl == "torchvision"
        else lambda: _transformers_model(width),
        "dataset": Shapes(samples, image_size),
        "optimizer": {"name": "sgd", "lr": lr, "momentum": 0.9, "weight_decay": 1e-4},
        "lr_schedule": {"warmup_steps": 10, "total_steps": total_steps},
        "grad_clip_norm": 5.0,
    }
    if impl == "torchvision":
        # torchvision's forward takes the image tensor and returns logits.
        definition["loss"] = loss
    return definition
