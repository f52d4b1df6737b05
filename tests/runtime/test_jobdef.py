"""Job definitions and their geometry, in-process (no worker processes): loading a user's job
module, its errors, the LR schedule, the sampler, the TP/PP geometry of real model classes,
a plain-PyTorch loop equal to the runtime's one-worker arithmetic, export round trip."""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import pytest
import torch

from worker_agent.runtime.errors import JobSpecError
from worker_agent.runtime.export import read_export, write_export
from worker_agent.runtime.job import TensorParallel
from worker_agent.runtime.jobdef import LRSchedule, load_definition
from worker_agent.runtime.models import definition_for
from worker_agent.runtime.module_job import StageModel, StepSampler, describe, load_micro_batch
from worker_agent.runtime.module_worker import ModuleWorker
from worker_agent.runtime.presets import JobSpec
from worker_agent.sharding import Layout, shard_map

JOB_MODULE = """
import torch
from torch import nn

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        x = torch.full((4,), float(i % 7))
        return {"x": x, "y": x.sum(0, keepdim=True)}

def job(width=8):
    return {
        "model": lambda: nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1)),
        "dataset": Squares(),
        "loss": lambda model, batch: ((model(batch["x"]) - batch["y"]) ** 2).mean(),
        "blocks": None,
    }

def not_a_job():
    return 42
"""


def test_job_module_on_the_workdir_is_loaded(tmp_path: Path) -> None:
    (tmp_path / "user_job_a.py").write_text(JOB_MODULE)
    defn = load_definition("user_job_a:job", {"width": 16}, str(tmp_path))
    assert isinstance(defn.model(), torch.nn.Module)
    assert defn.optimizer.name == "adamw" and len(defn.dataset) == 64


def test_bad_job_modules_fail_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "user_job_b.py").write_text(JOB_MODULE)
    (tmp_path / "user_job_broken.py").write_text("import no_such_package_xyz\n")
    with pytest.raises(JobSpecError, match=r"cannot import job module .user_job_broken.*No"):
        load_definition("user_job_broken:job", workdir=str(tmp_path))
    with pytest.raises(JobSpecError, match="has no function 'missing'"):
        load_definition("user_job_b:missing", workdir=str(tmp_path))
    with pytest.raises(JobSpecError, match="returned int"):
        load_definition("user_job_b:not_a_job", workdir=str(tmp_path))
    with pytest.raises(JobSpecError, match="raised TypeError"):
        load_definition("user_job_b:job", {"depth": 3}, str(tmp_path))
    with pytest.raises(JobSpecError, match=r"package\.module:function"):
        load_definition("no_colon")
    with pytest.raises(JobSpecError, match="unknown model 'gpt5'"):
        definition_for(JobSpec(model="gpt5"))


def test_lr_schedule_is_warmup_then_cosine() -> None:
    s = LRSchedule(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [s.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(4) == pytest.approx(1.0)
    assert s.factor(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s.factor(14) == pytest.approx(0.1) and s.factor(100) == pytest.approx(0.1)
    assert LRSchedule(kind="constant", warmup_steps=2).factor(50) == 1.0


def test_sampler_is_a_fresh_permutation_per_epoch_and_deterministic() -> None:
    a, b = StepSampler(10, seed=3, shuffle=True), StepSampler(10, seed=3, shuffle=True)
    first = [a.index(k) for k in range(10)]
    assert sorted(first) == list(range(10))
    assert [b.index(k) for k in range(25)][:10] == first
    assert sorted(a.index(k) for k in range(10, 20)) == list(range(10))
    assert [StepSampler(10, 0, shuffle=False).index(k) for k in (0, 9, 10)] == [0, 9, 0]


def test_llama_geometry_follows_its_config_plans() -> None:
    """LlamaConfig's base_model_tp_plan: q/k/v/gate/up colwise, o/down rowwise (stored
    transposed so that a shard is one contiguous range); the blocks are model.layers."""
    defn = definition_for(JobSpec(model="llama-tiny", global_batch_size=4, micro_batch_size=2))
    info, init = describe(defn)
    specs = {s.name: s for s in info.specs}
    assert info.block_path == "model.layers" and info.n_blocks == 4
    q = specs["model.layers.0.self_attn.q_proj.weight"]
    o = specs["model.layers.0.self_attn.o_proj.weight"]
    assert (q.kind, q.transposed, o.kind, o.transposed) == ("split0", False, "split0", True)
    assert specs["model.layers.0.input_layernorm.weight"].kind == "replicated"
    assert specs["model.embed_tokens.weight"].unit == -1
    assert specs["lm_head.weight"].unit == info.n_blocks
    # 2 KV heads: TP must keep whole heads.
    assert info.shape.tp_divisor == 2
    assert info.shape.n_params == sum(p.numel() for p in defn.model().parameters())
    assert set(init) == {f"param/{s.name}" for s in info.specs}


def test_tied_weights_are_held_by_both_end_stages() -> None:
    defn = definition_for(JobSpec(model="gpt2-tiny", global_batch_size=4, micro_batch_size=2))
    info, _ = describe(defn)
    wte = next(s for s in info.specs if s.name == "transformer.wte.weight")
    assert set(wte.units) == {-1, info.n_blocks}
    assert info.aliases["transformer.wte.weight"] == ["lm_head.weight"]
    lay = Layout(pp=2)
    for rank in range(2):
        names = {p.spec.name for p in shard_map(info.specs, info.n_blocks, lay, rank).params}
        assert "transformer.wte.weight" in names


def one_worker(spec: JobSpec) -> ModuleWorker:
    """The runtime's worker for a module job on one rank, in this process (no process group:
    one rank needs no collective), from the job's seeded initial state."""
    defn = definition_for(spec)
    info, init = describe(defn)
    smap = shard_map(info.specs, info.n_blocks, Layout(), 0, info.state_kinds)
    flat = torch.zeros(smap.n_state_elems)
    for h in smap.holdings():
        if h.tensor in init:
            flat[h.offset : h.offset + h.numel] = init[h.tensor][h.start : h.end]
    worker = ModuleWorker.__new__(ModuleWorker)
    worker.spec, worker.defn, worker.device = spec, defn, torch.device("cpu")
    worker.kinds, worker.specs, worker.n_blocks, worker.info = (
        info.state_kinds,
        info.specs,
        info.n_blocks,
        info,
    )
    worker.sampler = StepSampler(len(defn.dataset), defn.seed, defn.shuffle)
    worker.layout, worker.rank, worker.step, worker.smap, worker.flat = Layout(), 0, 0, smap, flat
    worker.grad_flat, worker.optimizer, worker.dp_group, worker._ties = None, None, None, {}
    worker.stage = StageModel(defn, info, Layout(), 0, smap, flat, lambda: TensorParallel())
    return worker


def test_one_worker_arithmetic_is_plain_pytorch() -> None:
    """The runtime's one-worker step (flat views, torch.optim over the flat shard, gradient
    accumulation over micro-batches, clipping, warm-up) equals the textbook loop on the same
    model (dropout off, so no RNG is involved)."""
    spec = JobSpec(
        model="llama-tiny",
        global_batch_size=8,
        micro_batch_size=2,
        options={
            "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1},
            "lr_schedule": {"warmup_steps": 2, "total_steps": 5},
            "grad_clip_norm": 0.3,
        },
    )
    defn = definition_for(spec)
    # The textbook loop.
    torch.manual_seed(defn.seed)
    model = defn.model()
    model.config.use_cache = False  # type: ignore[union-attr]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, defn.lr_schedule.factor)
    sampler = StepSampler(len(defn.dataset), defn.seed, defn.shuffle)
    ref = []
    for step in range(3):
        opt.zero_grad()
        total = 0.0
        for m in range(4):
            batch = load_micro_batch(defn, sampler, step, m, torch.device("cpu"))
            loss = model(**batch).loss
            (loss / 4).backward()
            total += float(loss) / 4
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        sched.step()
        ref.append(total)
    worker = one_worker(spec)
    got = [worker._train_step().loss_part for _ in range(3)]
    assert got == pytest.approx(ref, rel=1e-5)
    for name, p in model.named_parameters():
        if name in worker.stage.params:
            torch.testing.assert_close(
                worker.stage.params[name].detach(), p.detach(), rtol=1e-4, atol=1e-6
            )


def test_export_round_trip_without_workers(tmp_path: Path) -> None:
    defn = definition_for(JobSpec(model="resnet-tiny", global_batch_size=4, micro_batch_size=2))
    info, init = describe(defn)
    state = dict(init)
    for s in info.specs:
        if not s.buffer:
            state[f"momentum_buffer/{s.name}"] = torch.full((s.numel,), 0.5)
    write_export(tmp_path, info, state, step=7, layout=Layout(dp=2))
    back, step = read_export(tmp_path, info)
    assert step == 7 and back.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    from transformers import ResNetForImageClassification

    model = ResNetForImageClassification.from_pretrained(tmp_path)
    bn = model.resnet.embedder.embedder.normalization
    batches = int(cast(torch.Tensor, bn.num_batches_tracked))
    assert batches == 7 * 2  # micro-batches per step x steps
    assert not math.isnan(float(next(model.parameters()).sum()))
