"""The wire schema between the scheduler and worker agents (imported by both sides)."""

from __future__ import annotations

# Workload presets a job spec may name; anything else must be a `module:function` entrypoint.
# gpt2/bert/mlp (and their -tiny variants) run on the built-in runtime presets; the others are
# the models of the public scaling profiles and run as stand-ins sized like them.
WORKLOAD_PRESETS: tuple[str, ...] = (
    "gpt2",
    "gpt-tiny",
    "bert",
    "bert-tiny",
    "mlp",
    "resnet50",
    "vgg16",
    "inception3",
    "deepspeech2",
)

ENTRYPOINT_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
WORKLOAD_PATTERN = (
    "^("
    + "|".join(p.replace("-", r"\-") for p in WORKLOAD_PRESETS)
    + "|"
    + ENTRYPOINT_PATTERN
    + ")$"
)
