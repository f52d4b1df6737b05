"""Map a GreenFlow workload (protocol.WorkloadSpec) to a runtime JobSpec.

`gpt2`, `bert` and `resnet50` are the real architectures at their real sizes (Hugging Face
classes, `worker_agent.runtime.models`); `package.module:function` is a user's job module.
`gpt-tiny`, `bert-tiny` and `mlp` are the runtime's tiny functional presets (GPT decoder, BERT
encoder, MLP; enough blocks for a pipeline stage per slot of the node), which start in a second
on CPU slots; `vgg16`, `inception3` and `deepspeech2` are MLP stand-ins (torchvision does not
import with the CPU torch here). The workload's global batch size is kept
exactly; the micro-batch size is chosen so that every data-parallel degree the node could use
divides the batch evenly.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from worker_agent.protocol import (
    ENTRYPOINT_PATTERN,
    MODULE_PRESETS,
    WORKLOAD_PRESETS,
    WorkloadSpec,
)
from worker_agent.runtime.presets import JobSpec

# Family of each preset on the runtime's built-in jobs.
Family = Literal["gpt", "bert", "mlp"]

PRESET_MODEL: dict[str, str] = {"gpt2": "gpt2-124m", "bert": "bert-base", "resnet50": "resnet50"}
assert set(PRESET_MODEL) == MODULE_PRESETS, "protocol.MODULE_PRESETS names the same presets"
"""Workloads that run as nn.Module jobs (built-in model names)."""

PRESET_FAMILY: dict[str, Family] = {
    "gpt-tiny": "gpt",
    "bert-tiny": "bert",
    "mlp": "mlp",
    "vgg16": "mlp",
    "inception3": "mlp",
    "deepspeech2": "mlp",
}
"""Workloads that run as a tiny functional preset."""

MAX_MICRO_BATCH = 16
"""Cap on samples per micro-batch: bigger ones only make the tiny CPU models use more memory."""

MIN_LAYERS = 4
MAX_LAYERS = 16


class WorkloadError(ValueError):
    """The workload cannot be run by this agent (unknown name, impossible batch size)."""


def micro_batch_size(global_batch_size: int, max_gpus: int) -> int:
    """Largest micro-batch (<= MAX_MICRO_BATCH) that divides the per-replica batch of every DP degree.

    DP degrees considered: every d <= max_gpus that divides the global batch.
    """
    if global_batch_size < 1:
        raise WorkloadError(f"global_batch_size must be >= 1, got {global_batch_size}")
    per_replica = 0
    for dp in range(1, max(1, max_gpus) + 1):
        if global_batch_size % dp == 0:
            per_replica = math.gcd(per_replica, global_batch_size // dp)
    return max(d for d in range(1, min(per_replica, MAX_MICRO_BATCH) + 1) if per_replica % d == 0)


def n_layers_for(max_gpus: int) -> int:
    """Blocks of the tiny model: enough pipeline stages for any GPU count of the node (4..16)."""
    return max(MIN_LAYERS, min(max_gpus, MAX_LAYERS))


def job_spec_for(workload: WorkloadSpec, max_gpus: int, workdir: str | None = None) -> JobSpec:
    """The runtime JobSpec that runs `workload` on a node with `max_gpus` slots (a job module
    imported from `workdir`, its unpacked bundle, with the workload's options)."""
    name = workload.workload
    preset: Family | None = PRESET_FAMILY.get(name)
    entrypoint: str | None = None
    mbs = micro_batch_size(workload.global_batch_size, max_gpus)
    model = PRESET_MODEL.get(name)
    if model is not None:
        return JobSpec(
            model=model,
            global_batch_size=workload.global_batch_size,
            micro_batch_size=mbs,
            seed=workload.seed,
        )
    if preset is None:
        if not re.fullmatch(ENTRYPOINT_PATTERN, name):
            raise WorkloadError(
                f"unknown workload {name!r}: use one of {', '.join(WORKLOAD_PRESETS)} "
                "or a 'package.module:function' entrypoint"
            )
        entrypoint = name
    return JobSpec(
        preset=preset,
        entrypoint=entrypoint,
        workdir=workdir if entrypoint is not None else None,
        options=dict(workload.options) if entrypoint is not None else {},
        n_layers=n_layers_for(max_gpus),
        d_model=32,
        n_heads=4,
        ffn_mult=4,
        vocab_size=64,
        seq_len=16,
        n_features=16,
        n_classes=8,
        global_batch_size=workload.global_batch_size,
        micro_batch_size=mbs,
        seed=workload.seed,
    )


def total_steps(workload: WorkloadSpec) -> int:
    """Optimizer steps until samples_done (= step x global batch) reaches total_samples."""
    return max(1, -(-workload.total_samples // workload.global_batch_size))
