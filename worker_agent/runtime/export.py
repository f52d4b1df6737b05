"""A module job's state in standard formats, readable without GreenFlow, and back.

    DIR/model.safetensors      the model's state dict (module-shaped tensors, the module's names;
                               a tied tensor once, under its first name)
    DIR/config.json            Hugging Face models: the config, so `from_pretrained(DIR)` loads
    DIR/optimizer.safetensors  optimizer state per parameter: `exp_avg/<name>`, ...
    DIR/greenflow.json         step, optimizer state kinds, layout at export

Runs in the agent on gathered tensors: no user code is imported here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from worker_agent.runtime.errors import JobSpecError
from worker_agent.runtime.module_job import ModelInfo, from_module_tensor, to_module_tensor
from worker_agent.sharding import Layout


def write_export(
    directory: Path, info: ModelInfo, state: dict[str, torch.Tensor], step: int, layout: Layout
) -> Path:
    """Write `state` (gathered logical tensors) as described in the module docstring."""
    directory.mkdir(parents=True, exist_ok=True)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    micro_per_step = info.shape.global_batch_size // info.shape.micro_batch_size
    for spec in info.specs:
        if spec.buffer:
            model[spec.name] = to_module_tensor(spec, state[f"buffer/{spec.name}"])
            continue
        model[spec.name] = to_module_tensor(spec, state[f"param/{spec.name}"])
        for kind in info.state_kinds[1:]:
            optim[f"{kind}/{spec.name}"] = to_module_tensor(spec, state[f"{kind}/{spec.name}"])
    for name, value in info.static_buffers.items():
        if name.endswith("num_batches_tracked"):
            # Every micro-batch is one BatchNorm forward, as in one worker running them all.
            model[name] = torch.tensor(step * micro_per_step, dtype=value.dtype)
        elif not any(name == a for names in info.aliases.values() for a in names):
            model[name] = value.contiguous()
    save_file(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if optim:
        save_file(optim, str(directory / "optimizer.safetensors"))
    if info.hf_config is not None:
        (directory / "config.json").write_text(info.hf_config)
    meta = {
        "step": step,
        "state_kinds": list(info.state_kinds),
        "model_class": info.model_class,
        "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp},
    }
    (directory / "greenflow.json").write_text(json.dumps(meta, indent=2))
    return directory


def read_export(
    directory: Path, info: ModelInfo, weights_only: bool = False
) -> tuple[dict[str, torch.Tensor], int]:
    """Logical state tensors and step from an exported directory, or from a safetensors state
    dict file with the model's names (a Hugging Face `model.safetensors`, `save_file(model.
    state_dict())`): the step is then 0 and the optimizer starts fresh, as with `weights_only`."""
    path = directory if directory.is_file() else directory / "model.safetensors"
    if not path.is_file():
        raise JobSpecError(f"{directory}: no model.safetensors")
    try:
        weights = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types on a bad file
        raise JobSpecError(f"{path}: not a safetensors file: {exc}") from exc
    out: dict[str, torch.Tensor] = {}
    for spec in info.specs:
        names = [spec.name, *info.aliases.get(spec.name, [])]
        found = next((n for n in names if n in weights), None)
        if found is None:
            raise JobSpecError(f"{path}: no tensor {spec.name!r}")
        kind = "buffer" if spec.buffer else "param"
        out[f"{kind}/{spec.name}"] = from_module_tensor(spec, weights[found])
    step = 0
    if weights_only or directory.is_file():
        return out, step
    optim_path = directory / "optimizer.safetensors"
    meta_path = directory / "greenflow.json"
    if optim_path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if tuple(meta.get("state_kinds", ())) == info.state_kinds:
            optim = load_file(str(optim_path))
            for spec in info.specs:
                for kind in info.state_kinds[1:]:
                    key = f"{kind}/{spec.name}"
                    if key in optim:
                        out[key] = from_module_tensor(spec, optim[key])
            step = int(meta["step"])
    return out, step
