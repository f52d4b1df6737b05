"""Load the exported classifier with plain transformers / torch (no GreenFlow) and score it.

python classify.py EXPORT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from resnet_job import CLASSES, Shapes
from safetensors.torch import load_file


def load(export_dir: str) -> torch.nn.Module:
    """The exported model: `from_pretrained` when it is a transformers model, else torchvision's
    resnet18 with the exported state dict."""
    if (Path(export_dir) / "config.json").is_file():
        from transformers import ResNetForImageClassification

        return ResNetForImageClassification.from_pretrained(export_dir)
    import torchvision

    model = torchvision.models.resnet18(num_classes=len(CLASSES))
    model.load_state_dict(load_file(str(Path(export_dir) / "model.safetensors")))
    return model


def accuracy(model: torch.nn.Module, n: int = 256, image_size: int = 32) -> float:
    """Accuracy on `n` fresh images (a seed the training set did not use)."""
    model.eval()
    data = Shapes(n, image_size, seed=12345)
    batch = torch.utils.data.default_collate([data[i] for i in range(n)])
    with torch.no_grad():
        out = model(batch["pixel_values"])
    logits = out.logits if hasattr(out, "logits") else out
    return float((logits.argmax(-1) == batch["labels"]).float().mean())


if __name__ == "__main__":
    print(f"accuracy {accuracy(load(sys.argv[1])):.3f}")
