"""Presets, job specs and the flat-buffer AdamW, in one process (tp=1, no process group)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from worker_agent.runtime.errors import JobSpecError
from worker_agent.runtime.job import TensorParallel, TrainingJob
from worker_agent.runtime.optim import adamw_step
from worker_agent.runtime.presets import JobSpec, OptimizerSpec, build_job


def _full_params(job: TrainingJob, seed: int) -> dict[str, torch.Tensor]:
    return {p.name: p.init_full(seed).requires_grad_(True) for p in job.param_specs()}


@pytest.mark.parametrize("preset", ["gpt", "bert", "mlp"])
def test_presets_learn_on_their_synthetic_stream(preset: str) -> None:
    spec = JobSpec(preset=preset, optimizer=OptimizerSpec(lr=3e-3))  # type: ignore[arg-type]
    job = build_job(spec)
    params = _full_params(job, spec.seed)
    opt = torch.optim.Adam(params.values(), lr=3e-3)
    tp = TensorParallel()
    losses = []
    for step in range(40):
        batch = job.batch(step, spec.global_batch_size)
        h = job.embed(params, batch)
        for i in range(job.n_blocks()):
            h = job.block(i, params, h, tp)
        loss = job.head_loss(params, h, batch) / spec.global_batch_size
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) < sum(losses[:5])


def test_synthetic_stream_is_seeded() -> None:
    a = build_job(JobSpec(seed=1)).batch(3, 4)
    b = build_job(JobSpec(seed=1)).batch(3, 4)
    c = build_job(JobSpec(seed=2)).batch(3, 4)
    assert torch.equal(a["inputs"], b["inputs"])
    assert not torch.equal(a["inputs"], c["inputs"])


def test_init_is_independent_of_layout_and_order() -> None:
    specs = build_job(JobSpec()).param_specs()
    first = {p.name: p.init_full(0) for p in specs}
    for p in reversed(specs):
        assert torch.equal(p.init_full(0), first[p.name])


def test_flat_adamw_matches_torch_adamw() -> None:
    opt_spec = OptimizerSpec(lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    p_ref = torch.randn(50, requires_grad=True)
    ref = torch.optim.AdamW([p_ref], lr=1e-2, weight_decay=0.1, foreach=False)
    flat = torch.zeros(150)
    flat[:50] = p_ref.detach()
    for step in range(1, 6):
        g = torch.randn(50)
        p_ref.grad = g.clone()
        ref.step()
        adamw_step(flat, g, step, opt_spec)
    torch.testing.assert_close(flat[:50], p_ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(flat[50:100], ref.state[p_ref]["exp_avg"], rtol=1e-6, atol=1e-7)


def test_job_spec_errors_name_the_problem() -> None:
    with pytest.raises(ValidationError, match="multiple of n_heads"):
        JobSpec(d_model=30, n_heads=4)
    # A user's entrypoint is an nn.Module job (tests/runtime/test_jobdef.py): built only in its
    # worker processes, never here.
    with pytest.raises(JobSpecError, match=r"nn\.Module job"):
        build_job(JobSpec(entrypoint="no_such_module:make"))
