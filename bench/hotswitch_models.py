"""Hot-switch cost on real architectures at real sizes (the built-in nn.Module jobs): the pause,
bytes moved vs the lower bound, checkpoint-and-restart, and the training time a switch costs a
job that keeps training. Run through `python -m bench.hotswitch --model ...`; prints JSON.

Workers are CPU processes on gloo (loopback) here; on a GPU node the same code runs on NCCL.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.runner import JobRunner, SwitchReport
from worker_agent.sharding import Layout

Pair = tuple[int, Layout, int, Layout]

MODEL_PAIRS: dict[str, list[Pair]] = {
    "gpt2-124m": [(2, Layout(tp=2), 2, Layout(pp=2)), (1, Layout(), 2, Layout(dp=2))],
    "llama-350m": [(2, Layout(tp=2), 2, Layout(pp=2))],
    "bert-base": [(2, Layout(tp=2), 2, Layout(pp=2)), (1, Layout(), 2, Layout(dp=2))],
    "resnet50": [(2, Layout(dp=2), 2, Layout(pp=2)), (1, Layout(), 2, Layout(dp=2))],
}
"""Per model, (src gpus, src, dst gpus, dst); each is run forward and back. LLaMA-350M runs only
sharded layouts: a replica holds 4.2 GB of fp32 state, and a switch holds old and new side by
side, too much beside the other engineers' jobs on this 24 GB machine."""
QUICK: dict[str, list[Pair]] = {"gpt2-124m": [(2, Layout(tp=2), 2, Layout(pp=2))]}

DEFINITIONS = {
    "switch_s": "training paused by the switch (regroup + transfer + commit + sub-groups)",
    "bytes_moved / bytes_lower_bound": "bytes that crossed between workers / the elements some "
    "worker needs and does not hold, x 4 B (fp32 parameters, optimizer state, BatchNorm stats)",
    "stage_s_overlapped, spawn_s_overlapped": "before the pause, while the job may train",
    "restart_s": "the same change by checkpoint-and-restart: every worker torch.saves its shard "
    "(per-rank files on local disk), every worker process exits, new processes spawn (import "
    "torch and transformers), rebuild the model on the meta device and load their shards of "
    "the new layout from the files (resharding by the switch planner); the model's geometry is "
    "reused (no second random initialisation), which favours the restart",
    "speedup_vs_restart": "restart_s / switch_s",
    "lost_s": "on a job that trains in the background: resize wall time - steps finished "
    "meanwhile / the step rate just before (one step resolution: lost_s_resolution); the "
    "restart alternative loses its whole restart_s",
}


def _spec(model: str) -> JobSpec:
    # A small global batch: the bench measures the switch, not training throughput.
    return JobSpec(model=model, global_batch_size=4, micro_batch_size=1)


def _case(model: str, n_params: int, rep: SwitchReport, restart_s: float | None) -> dict[str, Any]:
    return {
        "model": model,
        "params": n_params,
        "src": str(rep.src),
        "dst": str(rep.dst),
        "switch_s": round(rep.switch_s, 4),
        "bytes_moved": rep.bytes_moved,
        "bytes_lower_bound": rep.bytes_lower_bound,
        "bytes_pulled": rep.bytes_pulled,
        "exchange_s": round(rep.exchange_s, 4),
        "local_s": round(rep.local_s, 4),
        "regroup_s": round(rep.regroup_s, 4),
        "stage_s_overlapped": round(rep.stage_s, 3),
        "spawn_s_overlapped": round(rep.spawn_s, 3),
        "restart_s": None if restart_s is None else round(restart_s, 3),
        "speedup_vs_restart": None if restart_s is None else round(restart_s / rep.switch_s, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _restart(run: JobRunner, spec: JobSpec, gpus: int, layout: Layout) -> tuple[JobRunner, float]:
    """Checkpoint, stop every worker, start new ones in `layout`, load resharded."""
    info = run.model_info
    with tempfile.TemporaryDirectory(prefix="gf-ckpt-") as d:
        t0 = time.perf_counter()
        ckpt = run.save_checkpoint(d)
        run.stop()
        fresh = JobRunner()
        fresh.start(spec, gpus, layout, checkpoint=ckpt, model_info=info)
        return fresh, time.perf_counter() - t0


def _next_step(run: JobRunner) -> tuple[int, float]:
    s0 = run.step_progress().step
    while (s := run.step_progress().step) == s0:
        time.sleep(0.005)
    return s, time.perf_counter()


def _lost(run: JobRunner, gpus: int, layout: Layout, window_s: float) -> dict[str, Any]:
    """Switch while the job trains in the background; the training time the switch cost."""
    run.run_background()
    s0, t0 = _next_step(run)
    time.sleep(window_s)
    s1, t1 = _next_step(run)
    rate = (s1 - s0) / (t1 - t0)
    start_step, t_start = run.step_progress().step, time.perf_counter()
    report = run.resize(gpus, layout)
    wall_s = time.perf_counter() - t_start
    steps = run.step_progress().step - start_step
    run.pause()
    lost_s = max(0.0, wall_s - steps / rate)
    return {
        "lost_src": str(report.src),
        "lost_dst": str(report.dst),
        "rate_steps_per_s": round(rate, 3),
        "resize_wall_s": round(wall_s, 3),
        "steps_during": steps,
        "lost_s": round(lost_s, 3),
        "lost_s_resolution": round(1 / rate, 3),
    }


def run_model_pair(model: str, pair: Pair, window_s: float, lost: bool) -> list[dict[str, Any]]:
    """Switch src -> dst -> src; restart src -> dst -> src; optionally the training time lost."""
    spec = _spec(model)
    src_n, src, dst_n, dst = pair
    run = JobRunner()
    try:
        run.start(spec, src_n, src)
        assert run.model_info is not None
        n_params = run.model_info.shape.n_params
        run.train(1)  # non-zero optimizer state
        fwd = run.resize(dst_n, dst)
        back = run.resize(src_n, src)
        run, restart_fwd = _restart(run, spec, dst_n, dst)
        run, restart_back = _restart(run, spec, src_n, src)
        cases = [
            _case(model, n_params, fwd, restart_fwd),
            _case(model, n_params, back, restart_back),
        ]
        if lost:
            cases[0].update(_lost(run, dst_n, dst, window_s))
            cases[1].update(_lost(run, src_n, src, window_s))
    finally:
        run.stop()
    return cases
