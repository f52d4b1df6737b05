"""The runner's side of a multi-node test, run inside node A's namespace; prints one JSON line.

`python -m tests.multinode.driver CASE '{"hosts": {"b": ["198.18.0.3", port]}, ...}'`, with
the worker hosts' secret in GREENFLOW_WORKER_HOST_KEY. The unswitched reference run is made
here too (loopback, same process), so both runs see the same torch build and threads.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

from worker_agent.protocol import worker_grant
from worker_agent.runtime.errors import SwitchFailed, WorkerFailed
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.remote import HOST_KEY_ENV, HostClient
from worker_agent.runtime.runner import GpuSlot, JobRunner, SwitchReport
from worker_agent.runtime.switch import SwitchCoordinator
from worker_agent.sharding import Layout

SPEC = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)
STEPS = 2
"""Steps between two switches."""


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def _report(r: SwitchReport) -> dict[str, Any]:
    keys = (
        "ok", "step", "switch_s", "bytes_moved", "bytes_lower_bound", "bytes_cross_node",
        "bytes_cross_node_min", "workers_started", "workers_released", "recovered_from", "error",
    )  # fmt: skip
    d = asdict(r)
    return {k: d[k] for k in keys} | {"src": str(r.src), "dst": str(r.dst)}


def _runner(args: dict[str, Any], **kw: Any) -> JobRunner:
    # The grant a scheduler would give job 1's runner on this node for each host's node.
    grant = worker_grant(os.environ[HOST_KEY_ENV], 1, "a").encode()
    hosts = {n: HostClient((a, int(p)), grant, 1, "a") for n, (a, p) in args["hosts"].items()}
    return JobRunner(store_host=args["address"], hosts=hosts, timeout_s=args["timeout_s"], **kw)


def _max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b if k.startswith("param/"))


def grow_shrink(args: dict[str, Any]) -> dict[str, Any]:
    """1 worker on A -> A+B (pp=2) -> back to A, against an unswitched 1-worker run."""
    with JobRunner(snapshot_policy="none") as ref:
        ref.start(SPEC, 1, Layout())
        ref_losses = [loss for _, loss in ref.train(3 * STEPS)]
        ref_state = ref.gather_state()
    a0, b0 = GpuSlot("a", 0), GpuSlot("b", 0)
    out: dict[str, Any] = {"ref_losses": ref_losses}
    with _runner(args, snapshot_policy="none") as run:
        run.start(SPEC, [a0], Layout())
        losses = [loss for _, loss in run.train(STEPS)]
        out["pids_start"] = run.worker_pids()
        tx0 = _tx_bytes()
        grow = run.resize([a0, b0], Layout(pp=2))
        out["tx_bytes_grow"] = _tx_bytes() - tx0
        out["pids_grown"] = run.worker_pids()
        out["slots_grown"] = [s.node for s in run.slots()]
        losses += [loss for _, loss in run.train(STEPS)]
        shrink = run.resize([a0], Layout())
        out["pids_end"] = run.worker_pids()
        losses += [loss for _, loss in run.train(STEPS)]
        out["step_end"] = run.step_progress().step
        out["max_param_diff"] = _max_param_diff(run.gather_state(), ref_state)
    out |= {"losses": losses, "grow": _report(grow), "shrink": _report(shrink)}
    return out


def _pids_by_slot(run: JobRunner) -> dict[str, int]:
    return {f"{s.node}:{s.index}": p for s, p in zip(run.slots(), run.worker_pids(), strict=True)}


def grow_three(args: dict[str, Any]) -> dict[str, Any]:
    """2 workers on A (dp=2) -> 6 on A+B+C (dp=3, pp=2) -> back to A's 2, against an
    unswitched 1-worker run (a global batch of 12 splits evenly over 1, 2 and 3 replicas)."""
    spec = SPEC.model_copy(update={"global_batch_size": 12})
    with JobRunner(snapshot_policy="none") as ref:
        ref.start(spec, 1, Layout())
        ref_losses = [loss for _, loss in ref.train(3 * STEPS)]
        ref_state = ref.gather_state()
    home = [GpuSlot("a", 0), GpuSlot("a", 1)]
    everywhere = home + [GpuSlot(n, i) for n in ("b", "c") for i in (0, 1)]
    out: dict[str, Any] = {"ref_losses": ref_losses}
    with _runner(args, snapshot_policy="none") as run:
        run.start(spec, home, Layout(dp=2))
        losses = [loss for _, loss in run.train(STEPS)]
        out["pids_start"] = _pids_by_slot(run)
        grow = run.resize(everywhere, Layout(dp=3, pp=2))
        out["pids_grown"] = _pids_by_slot(run)
        out["nodes_grown"] = sorted({s.node for s in run.slots()})
        losses += [loss for _, loss in run.train(STEPS)]
        shrink = run.resize(home, Layout(dp=2))
        out["pids_end"] = _pids_by_slot(run)
        losses += [loss for _, loss in run.train(STEPS)]
        out["step_end"] = run.step_progress().step
        out["max_param_diff"] = _max_param_diff(run.gather_state(), ref_state)
    out |= {"losses": losses, "grow": _report(grow), "shrink": _report(shrink)}
    return out


def link_cut(args: dict[str, Any]) -> dict[str, Any]:
    """Grow A -> A+B; the test cuts B's link once B's workers are staged: must roll back."""
    a0, a1, b0, b1 = GpuSlot("a", 0), GpuSlot("a", 1), GpuSlot("b", 0), GpuSlot("b", 1)
    stage = SwitchCoordinator.stage
    cut_at: list[float] = []

    def stage_then_wait(self: SwitchCoordinator, *a: Any) -> None:
        stage(self, *a)
        _wait_for_test("staged")  # the test cuts the link now
        cut_at.append(time.monotonic())

    SwitchCoordinator.stage = stage_then_wait  # type: ignore[method-assign,assignment]
    out: dict[str, Any] = {}
    with _runner(args, snapshot_policy="before_switch") as run:
        run.start(SPEC, [a0, a1], Layout(dp=2))
        losses = [loss for _, loss in run.train(STEPS)]
        out["pids_start"] = run.worker_pids()
        try:
            run.resize([a0, a1, b0, b1], Layout(dp=2, pp=2))
            out["outcome"] = "switched"
        except SwitchFailed as exc:
            out["outcome"] = "rolled-back"
            out["recovered_from"] = exc.recovered_from
        except WorkerFailed as exc:
            out["outcome"] = f"failed: {exc}"
        out["fail_s"] = time.monotonic() - cut_at[0]
        out["layout_after"] = str(run.layout)
        out["pids_after"] = run.worker_pids()
        losses += [loss for _, loss in run.train(STEPS)]
        out["losses"] = losses
        out["step_end"] = run.step_progress().step
    with JobRunner(snapshot_policy="none") as ref:
        ref.start(SPEC, 2, Layout(dp=2))
        out["ref_losses"] = [loss for _, loss in ref.train(2 * STEPS)]
    return out


def _wait_for_test(tag: str) -> None:
    print(json.dumps({tag: True}), flush=True)
    sys.stdin.readline()


def node_lost(args: dict[str, Any]) -> dict[str, Any]:
    """A+B train; the test kills node B; the job goes on on A from replicas or a checkpoint."""
    a0, b0 = GpuSlot("a", 0), GpuSlot("b", 0)
    layout = Layout(dp=2) if args["replicas"] else Layout(pp=2)
    out: dict[str, Any] = {}
    with _runner(args, snapshot_policy="none") as run:
        run.start(SPEC, [a0, b0], layout)
        losses = [loss for _, loss in run.train(STEPS)]
        ckpt = run.save_checkpoint(args["checkpoint_dir"])
        losses += [loss for _, loss in run.train(1)]
        out["pid_a"] = run.worker_pids()[0]
        _wait_for_test("trained")  # node B is killed now
        t0 = time.monotonic()
        try:
            run.train(1)
            out["noticed"] = False
        except WorkerFailed as exc:
            out["noticed"] = str(exc)[:300]
        out["notice_s"] = time.monotonic() - t0
        rec = run.recover([a0], Layout(), checkpoint=ckpt)
        out["recovery"] = {
            "recovered_from": rec.recovered_from,
            "lost_nodes": rec.lost_nodes,
            "lost_pids": rec.lost_pids,
            "step_reached": rec.step_reached,
            "step": rec.step,
            "steps_lost": rec.steps_lost,
            "bytes_moved": rec.bytes_moved,
            "recover_s": rec.recover_s,
        }
        out["pid_a_after"] = run.worker_pids()[0]
        del losses[rec.step :]
        losses += [loss for _, loss in run.train(STEPS)]
        out["losses"] = losses
        out["step_end"] = run.step_progress().step
    with JobRunner(snapshot_policy="none") as ref:
        ref.start(SPEC, 1, Layout())
        out["ref_losses"] = [loss for _, loss in ref.train(len(losses))]
    return out


def node_lost_in_switch(args: dict[str, Any]) -> dict[str, Any]:
    """A+B (dp=2) grows to 2+2 workers; the test kills node B once staged; recover on A."""
    a0, a1, b0, b1 = GpuSlot("a", 0), GpuSlot("a", 1), GpuSlot("b", 0), GpuSlot("b", 1)
    stage = SwitchCoordinator.stage

    def stage_then_wait(self: SwitchCoordinator, *a: Any) -> None:
        stage(self, *a)
        _wait_for_test("staged")  # node B is killed now

    SwitchCoordinator.stage = stage_then_wait  # type: ignore[method-assign,assignment]
    out: dict[str, Any] = {}
    with _runner(args, snapshot_policy="none") as run:
        run.start(SPEC, [a0, b0], Layout(dp=2))
        losses = [loss for _, loss in run.train(STEPS)]
        out["pid_a"] = run.worker_pids()[0]
        t0 = time.monotonic()
        try:
            run.resize([a0, a1, b0, b1], Layout(dp=2, tp=2))
            out["outcome"] = "switched"
        except SwitchFailed as exc:
            out["outcome"] = f"rolled back: {exc.recovered_from}"
        except WorkerFailed as exc:
            out["outcome"] = "failed"
            out["error"] = str(exc)[:400]
        out["fail_s"] = time.monotonic() - t0
        rec = run.recover([a0, a1], Layout(tp=2))
        out["recovered_from"] = rec.recovered_from
        out["lost_nodes"] = rec.lost_nodes
        out["pid_a_after"] = run.worker_pids()[0]
        losses += [loss for _, loss in run.train(STEPS)]
        out["losses"] = losses
        out["step_end"] = run.step_progress().step
    with JobRunner(snapshot_policy="none") as ref:
        ref.start(SPEC, 1, Layout())
        out["ref_losses"] = [loss for _, loss in ref.train(len(losses))]
    return out


def move_off_runner_node(args: dict[str, Any]) -> dict[str, Any]:
    """2 workers on A (dp=2) -> 2 on B (dp=2) -> back to A, the runner staying on A: every
    worker leaves the runner's node and comes back, against an unswitched 1-worker run."""
    with JobRunner(snapshot_policy="none") as ref:
        ref.start(SPEC, 1, Layout())
        ref_losses = [loss for _, loss in ref.train(3 * STEPS)]
        ref_state = ref.gather_state()
    home = [GpuSlot("a", 0), GpuSlot("a", 1)]
    away = [GpuSlot("b", 0), GpuSlot("b", 1)]
    out: dict[str, Any] = {"ref_losses": ref_losses}
    with _runner(args, snapshot_policy="none") as run:
        run.start(SPEC, home, Layout(dp=2))
        losses = [loss for _, loss in run.train(STEPS)]
        out["pids_start"] = _pids_by_slot(run)
        there = run.resize(away, Layout(dp=2))
        out["pids_away"] = _pids_by_slot(run)
        losses += [loss for _, loss in run.train(STEPS)]
        back = run.resize(home, Layout(dp=2))
        out["pids_end"] = _pids_by_slot(run)
        losses += [loss for _, loss in run.train(STEPS)]
        out["step_end"] = run.step_progress().step
        out["max_param_diff"] = _max_param_diff(run.gather_state(), ref_state)
    out |= {"losses": losses, "there": _report(there), "back": _report(back)}
    return out


CASES = {
    "move_off_runner_node": move_off_runner_node,
    "node_lost_in_switch": node_lost_in_switch,
    "grow_shrink": grow_shrink,
    "grow_three": grow_three,
    "link_cut": link_cut,
    "node_lost": node_lost,
}

if __name__ == "__main__":
    result = CASES[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
