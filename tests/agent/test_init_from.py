"""A module job started from an earlier job's export (`init_from`): the agent's job starts from
exactly those weights at step 0 with a fresh optimizer, and a missing or mismatched export fails
the job with its reason (the job's own fault, not the node's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker_agent.managed import ManagedJob
from worker_agent.protocol import WorkloadSpec
from worker_agent.runtime.errors import JobCodeFailed
from worker_agent.runtime.runner import GpuSlot, JobRunner
from worker_agent.workloads import job_spec_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

JOB = """
import torch


class Net(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, width), torch.nn.Linear(width, 1)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) if layer.out_features > 1 else layer(x)
        return x


def loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def job(width=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    return {
        "model": lambda: Net(width),
        "dataset": data,
        "loss": loss,
        "optimizer": {"name": "adamw", "lr": 0.01},
    }
"""


def _workload(**extra: object) -> WorkloadSpec:
    return WorkloadSpec.model_validate(
        {"workload": "user_job_init:job", "global_batch_size": 8, "total_samples": 8000, **extra}
    )


def _params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith("param/")}


def test_a_job_started_from_an_export_holds_its_weights_and_trains_on(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "user_job_init.py").write_text(JOB)
    exports = tmp_path / "exports"
    spec = job_spec_for(_workload(), 2, workdir=str(code))
    # Job 1 trains a few steps and is exported, as the agent does when a job finishes.
    with JobRunner(snapshot_policy="none", backend="gloo") as first:
        first.start(spec, [GpuSlot("n", 0)])
        first.train(5)
        first.export(exports / "job-1")
        trained = first.gather_state()
    exported = load_file(str(exports / "job-1" / "model.safetensors"))
    assert set(exported) == {
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    }

    # Job 2 names it: the agent's job starts at step 0 from exactly those weights.
    workload = _workload(init_from="job:1")
    job = ManagedJob(
        2,
        workload,
        job_spec_for(workload, 2, workdir=str(code)),
        node="n",
        backend="gloo",
        export_root=exports,
    )
    with job.lock:
        job.start([0])
        job.pause()  # the driver stops; the full state is kept in memory
    assert job.resumed_from == "the weights of job:1"
    assert job.ack(1).resumed_from == "the weights of job:1"
    assert job.paused is not None
    steps = job.paused.step
    assert steps > 0

    # The same number of steps from job 1's weights with a fresh optimizer, and from a fresh
    # model: job 2 is the first, bit for bit, and not the second.
    with JobRunner(snapshot_policy="none", backend="gloo") as ref:
        ref.start(spec, [GpuSlot("n", 0)], init_from=exports / "job-1", init_weights_only=True)
        assert ref.step_progress().step == 0
        for name, tensor in _params(ref.gather_state()).items():
            assert torch.equal(tensor, trained[name]), name
        ref.train(steps)
        expected = _params(ref.gather_state())
    with JobRunner(snapshot_policy="none", backend="gloo") as fresh:
        fresh.start(spec, [GpuSlot("n", 0)])
        fresh.train(steps)
        from_scratch = _params(fresh.gather_state())
    got = _params(job.paused.state)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.allclose(got[n], from_scratch[n]) for n in expected)
    with job.lock:
        job.stop()

    # A plain safetensors state dict with the model's names works the same way.
    state_file = tmp_path / "weights.safetensors"
    save_file(exported, str(state_file))
    with JobRunner(snapshot_policy="none", backend="gloo") as plain:
        plain.start(spec, [GpuSlot("n", 0)], init_from=state_file, init_weights_only=True)
        for name, tensor in _params(plain.gather_state()).items():
            assert torch.equal(tensor, trained[name]), name


def test_a_missing_or_mismatched_export_fails_the_job_with_its_reason(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "user_job_init.py").write_text(JOB)

    def managed(init_from: str, **options: object) -> ManagedJob:
        workload = _workload(init_from=init_from, options=options)
        spec = job_spec_for(workload, 1, workdir=str(code))
        return ManagedJob(3, workload, spec, node="n", backend="gloo", export_root=tmp_path)

    missing = managed("job:41")
    with missing.lock, pytest.raises(JobCodeFailed, match=r"init_from job:41: no .*job-41"):
        missing.start([0])
    # Another model size: the shapes do not fit.
    wide = tmp_path / "wide.safetensors"
    save_file(
        {
            "layers.0.weight": torch.zeros(32, 4),
            "layers.0.bias": torch.zeros(32),
            "layers.1.weight": torch.zeros(1, 32),
            "layers.1.bias": torch.zeros(1),
        },
        str(wide),
    )
    mismatched = managed(str(wide), width=16)
    with mismatched.lock, pytest.raises(JobCodeFailed, match="does not fit the model"):
        mismatched.start([0])
    assert mismatched.runner is None  # its workers are gone again
