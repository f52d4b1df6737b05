"""Training runtime: jobs, presets, layouts, worker processes and the parent-side JobRunner."""

from worker_agent.runtime.errors import (
    JobSpecError,
    LayoutError,
    SwitchFailed,
    WorkerFailed,
)
from worker_agent.runtime.job import ParamSpec, TensorParallel, TrainingJob
from worker_agent.runtime.layout import Layout, ModelShape, choose_layout
from worker_agent.runtime.pool import GpuSlot, JobRunner, Progress, SwitchReport
from worker_agent.runtime.presets import JobSpec, OptimizerSpec, build_job, model_shape

__all__ = [
    "GpuSlot",
    "JobRunner",
    "JobSpec",
    "JobSpecError",
    "Layout",
    "LayoutError",
    "ModelShape",
    "OptimizerSpec",
    "ParamSpec",
    "Progress",
    "SwitchFailed",
    "SwitchReport",
    "TensorParallel",
    "TrainingJob",
    "WorkerFailed",
    "build_job",
    "choose_layout",
    "model_shape",
]
