"""Hot switches on real worker processes (gloo): moved state is bitwise, training continues.

Tolerance: a switch that changes DP or TP changes summation order, so the trajectory can only
match an unswitched run to float32 rounding. Losses must agree to a relative 1e-5 (observed
~1e-7). Parameters must agree to 1 % of the largest total Adam movement, 0.01 x lr x steps:
Adam divides by sqrt(v) + eps, so a rounding-level gradient difference on an element whose true
gradient is ~0 (e.g. attention key biases) can move that element by up to lr x |g| / eps per
step; every other element agrees to ~1e-7.
"""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from worker_agent.runtime.presets import JobSpec, OptimizerSpec
from worker_agent.runtime.runner import GpuSlot, JobRunner, SwitchReport
from worker_agent.sharding import Layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 2


def _reference(
    spec: JobSpec, gpus: int, layout: Layout, steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    with JobRunner(snapshot_policy="none") as ref:
        ref.start(spec, gpus, layout)
        losses = [loss for _, loss in ref.train(steps)]
        return losses, ref.gather_state()


def _run_chain(
    spec: JobSpec,
    chain: list[tuple[int, Layout]] | list[tuple[list[GpuSlot], Layout]],
    direct_min_run_bytes: int | None = None,
    snapshot_policy: Literal["auto", "none"] = "none",
) -> tuple[list[float], dict[str, torch.Tensor], list[SwitchReport]]:
    """Train, switch along `chain`, train; with policy `none` every byte moves as a message."""
    reports: list[SwitchReport] = []
    with JobRunner(
        snapshot_policy=snapshot_policy, direct_min_run_bytes=direct_min_run_bytes
    ) as run:
        gpus, layout = chain[0]
        run.start(spec, gpus, layout)
        losses = [loss for _, loss in run.train(STEPS)]
        for gpus, layout in chain[1:]:
            before = run.gather_state()
            pid_of_slot = dict(zip(run.slots(), run.worker_pids(), strict=True))
            report = run.resize(gpus, layout)
            assert report.ok and run.layout == layout
            after = run.gather_state()
            # The moved parameters and optimizer state are bit-for-bit the same.
            assert before.keys() == after.keys()
            for name in before:
                assert torch.equal(before[name], after[name]), (
                    f"{name} changed in {report.src}->{layout}"
                )
            assert report.bytes_moved == report.bytes_lower_bound
            if snapshot_policy == "none":  # private state: nothing can be pulled
                assert report.bytes_pulled == 0
            # Workers on slots that stay keep their process.
            for slot, pid in zip(run.slots(), run.worker_pids(), strict=True):
                if slot in pid_of_slot:
                    assert pid == pid_of_slot[slot]
            assert report.step == STEPS * len(reports) + STEPS
            reports.append(report)
            losses += [loss for _, loss in run.train(STEPS)]
        return losses, run.gather_state(), reports


def _assert_same_trajectory(
    spec: JobSpec,
    losses: list[float],
    state: dict[str, torch.Tensor],
    ref_losses: list[float],
    ref_state: dict[str, torch.Tensor],
) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    atol = 0.01 * spec.optimizer.lr * len(losses)
    for name, ref in ref_state.items():
        if name.startswith("param/"):
            torch.testing.assert_close(state[name], ref, rtol=0, atol=atol, msg=name)


GPT_CHAIN = [
    (2, Layout(dp=2)),
    (2, Layout(tp=2)),  # dp -> tp, same workers
    (2, Layout(pp=2)),  # tp -> pp
    (4, Layout(dp=2, tp=2)),  # grow 2 -> 4, mixed
    (4, Layout(tp=2, pp=2)),
    (1, Layout()),  # shrink 4 -> 1
    (4, Layout(dp=2, pp=2)),  # grow 1 -> 4
    (4, Layout(tp=4)),
    (2, Layout(dp=2)),  # shrink 4 -> 2, back to the start layout
]


def test_gpt_switch_chain_matches_unswitched_run() -> None:
    spec = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)
    # 1 KiB threshold: weight runs go unpacked, bias/norm runs are fused (the mixed path).
    losses, state, reports = _run_chain(spec, GPT_CHAIN, direct_min_run_bytes=1024)
    ref_losses, ref_state = _reference(spec, 2, Layout(dp=2), len(losses))
    _assert_same_trajectory(spec, losses, state, ref_losses, ref_state)
    assert sum(r.bytes_moved for r in reports) > 0
    assert reports[0].bytes_moved == 0  # dp2 -> tp2: each worker already holds its TP half


def test_mlp_and_bert_switches_match_unswitched_runs() -> None:
    """Also runs the executor's unpacked path: every multi-piece message goes run by run."""
    mlp = JobSpec(preset="mlp", n_layers=2, d_model=32, optimizer=OptimizerSpec(lr=3e-3))
    chain = [(1, Layout()), (2, Layout(tp=2)), (2, Layout(pp=2))]
    losses, state, _ = _run_chain(mlp, chain, direct_min_run_bytes=0)
    ref_losses, ref_state = _reference(mlp, 1, Layout(), len(losses))
    _assert_same_trajectory(mlp, losses, state, ref_losses, ref_state)

    bert = JobSpec(preset="bert", n_layers=2, d_model=32, n_heads=4)
    chain = [(2, Layout(pp=2)), (2, Layout(dp=2))]
    losses, state, _ = _run_chain(bert, chain, direct_min_run_bytes=0)
    ref_losses, ref_state = _reference(bert, 2, Layout(pp=2), len(losses))
    _assert_same_trajectory(bert, losses, state, ref_losses, ref_state)


def test_shared_memory_pulls_and_messages_mix_across_nodes() -> None:
    """Default policy: same-node pairs copy out of the sender's shared state, others send."""
    spec = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)
    a0, a1, b0, b1 = GpuSlot("a", 0), GpuSlot("a", 1), GpuSlot("b", 0), GpuSlot("b", 1)
    chain = [
        ([a0, a1], Layout(tp=2)),
        ([a0, a1], Layout(pp=2)),  # one node: every byte pulled, no message
        ([a0, a1, b0, b1], Layout(tp=2, pp=2)),  # grow: only node b receives (messages)
        ([a0, b0], Layout(dp=2)),  # shrink across nodes: pulls and messages
        ([a0, a1], Layout(tp=2)),  # a1 is a new worker on a0's node: pulls only
    ]
    losses, state, reports = _run_chain(spec, chain, snapshot_policy="auto")
    ref_losses, ref_state = _reference(spec, 2, Layout(tp=2), len(losses))
    _assert_same_trajectory(spec, losses, state, ref_losses, ref_state)
    to_pp, grow, shrink, back = reports
    for r in (to_pp, back):
        assert r.bytes_moved > 0 and r.bytes_pulled == r.bytes_moved and r.messages == 0
    assert grow.bytes_moved > 0 and grow.bytes_pulled == 0 and grow.messages > 0
    assert 0 < shrink.bytes_pulled < shrink.bytes_moved and shrink.messages > 0
