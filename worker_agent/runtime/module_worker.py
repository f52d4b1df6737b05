"""A worker that trains a user's `torch.nn.Module` job (built-in model or job module).

Same state, process groups and hot switch as `Worker`; what differs is the compute: the job's
own module runs forward (a `StageModel` per layout, built before the pause while staging), the
job's optimizer (torch.optim.AdamW or SGD) updates the flat shard with its state tensors as views
into the same buffer, and the data comes from the job's dataset, sampled by step.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from worker_agent.hotswitch.execute import StagedSwitch
from worker_agent.runtime.errors import JobSpecError
from worker_agent.runtime.jobdef import JobDefinition
from worker_agent.runtime.models import definition_for
from worker_agent.runtime.module_job import (
    ModelInfo,
    StageModel,
    StepSampler,
    dataset_of,
    describe,
    load_micro_batch,
)
from worker_agent.runtime.worker import StepStats, Worker
from worker_agent.sharding import Layout, stages_of

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ModuleWorker(Worker):
    """One rank of an nn.Module job."""

    defn: JobDefinition
    info: ModelInfo | None = None

    def _load_job(self) -> None:
        self.defn = definition_for(self.spec)
        self.kinds = self.defn.optimizer.state_kinds
        self.sampler = StepSampler(len(dataset_of(self.defn)), self.defn.seed, self.defn.shuffle)
        self._ties: dict[tuple[Layout, int], list[tuple[list[int], Any]]] = {}
        """Per (layout, rank): groups of the stages that hold one tied tensor."""

    # ----- set-up ---------------------------------------------------------------------------
    def cmd_describe(self) -> tuple[ModelInfo, dict[str, torch.Tensor]]:
        """Build the model once: its geometry and initial state (sent as shared memory)."""
        info, init = describe(self.defn)
        for t in init.values():
            t.share_memory_()
        self.cmd_setup(info)
        return info, init

    def cmd_setup(self, info: ModelInfo) -> None:
        """Adopt the job's geometry (every worker, before it gets any state)."""
        self.info = info
        self.specs = info.specs
        self.n_blocks = info.n_blocks

    def cmd_init_state(self, layout: Layout, rank: int) -> int:
        """Not used: module jobs start from the describing worker's initial state."""
        raise JobSpecError("module jobs start through describe + restore")

    def _adopt(self, layout: Layout, rank: int, flat: torch.Tensor, prebuilt: Any) -> None:
        self.stage = prebuilt if prebuilt is not None else self._stage_model(layout, rank, flat)
        # A module-shaped view per held parameter replaces the functional presets' dict.
        self.params = dict(self.stage.params)
        self.optimizer = None

    def _stage_model(self, layout: Layout, rank: int, flat: torch.Tensor) -> StageModel:
        assert self.info is not None
        return StageModel(
            self.defn, self.info, layout, rank, self._smap(layout, rank), flat, self._tp
        )

    def _tp(self) -> Any:
        return self.tp

    def _prepare(self, staged: StagedSwitch, new_layout: Layout, new_rank: int) -> None:
        flat = staged.new_flat if staged.new_flat is not None else self.flat
        assert flat is not None
        staged.extra["stage_model"] = self._stage_model(new_layout, new_rank, flat)
        staged.profile.mark("model")

    def _make_groups(self, lay: Layout, me: int) -> Any:
        groups = super()._make_groups(lay, me)
        # Kept per layout: staging builds the next layout's while this one still trains.
        current = (self.layout, self.rank)
        self._ties = {k: v for k, v in self._ties.items() if k == current}
        self._ties[(lay, me)] = self._make_tie_groups(lay, me)
        return groups

    def _make_tie_groups(self, lay: Layout, me: int) -> list[tuple[list[int], Any]]:
        """Groups of the stages holding a tied tensor (same dp, tp): its gradient is summed."""
        out: list[tuple[list[int], Any]] = []
        if lay.pp == 1:
            return out
        c = lay.coords(me)
        sets = sorted(
            {tuple(stages_of(s, self.n_blocks, lay)) for s in self.specs if len(s.units) > 1}
        )
        for stages in sets:
            if len(stages) < 2:
                continue
            for d in range(lay.dp):
                for t in range(lay.tp):
                    ranks = [lay.rank_of(p, d, t) for p in stages]
                    g = dist.new_group(ranks, timeout=timedelta(seconds=self.cfg.timeout_s))
                    if d == c.dp and t == c.tp and c.pp in stages:
                        out.append((list(stages), g))
        return out

    # ----- training -------------------------------------------------------------------------
    def _train_step(self) -> StepStats:
        assert self.layout is not None and self.flat is not None
        t0 = time.perf_counter()
        lay, c = self.layout, self.layout.coords(self.rank)
        defn = self.defn
        n_micro = defn.global_batch_size // defn.micro_batch_size
        per_dp = n_micro // lay.dp
        micros = range(c.dp * per_dp, (c.dp + 1) * per_dp)
        stage: StageModel = self.stage
        stage.zero_grad()
        bn = self._bn_before()
        if lay.pp == 1:
            loss_sum = 0.0
            for m in micros:
                batch = load_micro_batch(defn, self.sampler, self.step, m, self.device)
                loss = stage.forward_loss(batch, self.step, m)
                (loss.float() / n_micro).backward()
                loss_sum += float(loss.detach()) / n_micro
            loss_part: float | None = loss_sum
        else:
            loss_part = self._gpipe_modules(list(micros), n_micro)
        if c.tp != 0:
            loss_part = None
        self._bn_after(bn, per_dp)
        self._module_optimizer_step()
        self.step += 1
        return StepStats(self.step - 1, loss_part, time.perf_counter() - t0)

    def _gpipe_modules(self, micros: list[int], n_micro: int) -> float | None:
        """GPipe over the stage models: all forwards, then all backwards; activations and their
        gradients travel with p2p between matching ranks of neighbouring stages."""
        assert self.layout is not None
        lay, stage = self.layout, self.stage
        stride = lay.dp * lay.tp
        prev_rank, next_rank = self.rank - stride, self.rank + stride
        saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        pending: list[Any] = []
        keep: list[torch.Tensor] = []
        for m in micros:
            batch = load_micro_batch(self.defn, self.sampler, self.step, m, self.device)
            h_in: torch.Tensor | None = None
            if not stage.first:
                header = torch.zeros(8, dtype=torch.int64, device=self.device)
                dist.recv(header, prev_rank)
                ndim = int(header[0])
                shape = tuple(int(x) for x in header[1 : 1 + ndim])
                h_in = torch.empty(shape, dtype=_DTYPES[int(header[7])], device=self.device)
                dist.recv(h_in, prev_rank)
                h_in.requires_grad_(True)
            stage.stage_input = h_in
            out = stage.forward_loss(batch, self.step, m)
            if not stage.last:
                header = torch.zeros(8, dtype=torch.int64, device=self.device)
                header[0] = out.dim()
                header[1 : 1 + out.dim()] = torch.tensor(out.shape)
                header[7] = _DTYPES.index(out.dtype)
                act = out.detach().contiguous()
                keep += [header, act]
                pending.append(dist.isend(header, next_rank))
                pending.append(dist.isend(act, next_rank))
            saved.append((h_in, out))
        stage.stage_input = None
        loss_sum = 0.0
        for h_in, out in saved:
            if stage.last:
                (out.float() / n_micro).backward()
                loss_sum += float(out.detach()) / n_micro
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, next_rank)
                torch.autograd.backward(out, grad)
            if h_in is not None:
                assert h_in.grad is not None
                g = h_in.grad.contiguous()
                keep.append(g)
                pending.append(dist.isend(g, prev_rank))
        for w in pending:
            w.wait()
        return loss_sum if stage.last else None

    def _bn_before(self) -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
        """Running statistics of every BatchNorm before the step (for the DP combination)."""
        assert self.layout is not None
        if self.layout.dp == 1:
            return []
        return [
            (mod, mod.running_mean.clone(), mod.running_var.clone())
            for mod in self.stage.batchnorms()
            if mod.momentum is not None
        ]

    def _bn_after(self, before: list[tuple[Any, torch.Tensor, torch.Tensor]], k: int) -> None:
        """Make every DP rank's running statistics what one worker running all micro-batches in
        order would have: r = a^(Dk) r0 + sum_d a^((D-1-d)k) (r_d - a^k r0), a = 1 - momentum."""
        assert self.layout is not None
        lay = self.layout
        d, dp = lay.coords(self.rank).dp, lay.dp
        for mod, mean0, var0 in before:
            a = 1.0 - float(mod.momentum)
            for buf, r0 in ((mod.running_mean, mean0), (mod.running_var, var0)):
                part = (buf - r0 * a**k) * a ** ((dp - 1 - d) * k)
                dist.all_reduce(part, group=self.dp_group)
                buf.copy_(r0 * a ** (dp * k) + part)

    def _module_optimizer_step(self) -> None:
        """Sum gradients over DP (and tied replicas), clip the global norm, step the optimizer."""
        assert self.smap is not None and self.flat is not None and self.layout is not None
        n = self.smap.n_param_elems
        if self.grad_flat is None:
            self.grad_flat = torch.empty(n, device=self.device)
        g = self.grad_flat
        self.stage.grads_into(g)
        if self.dp_group is not None:
            dist.all_reduce(g, group=self.dp_group)
        for stages, group in self._ties.get((self.layout, self.rank), []):
            for ps in self.smap.params:
                if list(stages_of(ps.spec, self.n_blocks, self.layout)) == stages:
                    seg = g[ps.offset : ps.offset + ps.end - ps.start]
                    dist.all_reduce(seg, group=group)
        if self.defn.grad_clip_norm is not None:
            self._clip(g, self.defn.grad_clip_norm)
        opt = self.defn.optimizer
        lr = opt.lr * self.defn.lr_schedule.factor(self.step)
        if self.optimizer is None:
            self.optimizer = self._make_optimizer()
        param = self.optimizer.param_groups[0]["params"][0]
        param.grad = g
        self.optimizer.param_groups[0]["lr"] = lr
        if opt.name == "adamw":
            self.optimizer.state[param]["step"] = torch.tensor(float(self.step))
        self.optimizer.step()
        param.grad = None

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """torch.optim's own optimizer over the flat parameter shard, its state views into the
        flat buffer (elementwise: the update of an element does not depend on the sharding)."""
        assert self.smap is not None and self.flat is not None
        n = self.smap.n_param_elems
        flat = self.flat
        param = flat[:n]
        opt = self.defn.optimizer
        optimizer: torch.optim.Optimizer
        if opt.name == "adamw":
            optimizer = torch.optim.AdamW(
                [param],
                lr=opt.lr,
                betas=opt.betas,
                eps=opt.eps,
                weight_decay=opt.weight_decay,
                foreach=False,
            )
            optimizer.state[param] = {
                "step": torch.tensor(float(self.step)),
                "exp_avg": flat[n : 2 * n],
                "exp_avg_sq": flat[2 * n : 3 * n],
            }
        else:
            optimizer = torch.optim.SGD(
                [param],
                lr=opt.lr,
                momentum=opt.momentum,
                nesterov=opt.nesterov,
                weight_decay=opt.weight_decay,
                foreach=False,
            )
            if opt.momentum > 0:
                # A zero buffer: torch's first step then leaves it = the gradient, as it does when
                # it creates the buffer itself (no dampening).
                optimizer.state[param] = {"momentum_buffer": flat[n : 2 * n]}
        return optimizer

    def _clip(self, g: torch.Tensor, max_norm: float) -> None:
        """Scale the gradient so the global norm over every logical element is <= max_norm."""
        assert self.smap is not None and self.layout is not None
        lay = self.layout
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for ps in self.smap.params:
            seg = g[ps.offset : ps.offset + ps.end - ps.start]
            # Count each logical element once: replicas over TP, over tied stages, and over DP
            # (added by the all-reduce over every rank below) are divided out.
            copies = len(stages_of(ps.spec, self.n_blocks, lay)) * lay.dp
            if ps.spec.kind != "split0" or lay.tp == 1:
                copies *= lay.tp
            total += seg.double().pow(2).sum() / copies
        if lay.world_size > 1:
            dist.all_reduce(total)
        norm = float(total.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            g.mul_(coef)
