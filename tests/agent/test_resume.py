"""Resume a job from its pause snapshot (memory) or from a checkpoint on shared storage (another
node): the resumed workers hold exactly the saved state and training continues on the same
trajectory.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from worker_agent.checkpoints import CheckpointStore
from worker_agent.managed import ManagedJob
from worker_agent.protocol import WorkloadSpec
from worker_agent.runtime.runner import GpuSlot, JobRunner
from worker_agent.workloads import job_spec_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WORKLOAD = WorkloadSpec(workload="gpt-tiny", global_batch_size=8, total_samples=64)


def _assert_same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_resume_from_memory_restores_state_and_trajectory() -> None:
    spec = job_spec_for(WORKLOAD, 2)
    # One uninterrupted run is the reference; its state after step 1 is what a pause saves.
    with JobRunner(snapshot_policy="none", backend="gloo") as ref:
        ref.start(spec, [GpuSlot("n", 0)])
        first_losses = [loss for _, loss in ref.train(1)]
        saved = ref.gather_state()
        assert ref.step_progress().step == 1
        ref_losses = first_losses + [loss for _, loss in ref.train(2)]
        ref_state = ref.gather_state()

    # Resume on two other slots (another layout): every logical tensor comes back bit for bit,
    # and the trajectory matches the uninterrupted run to float rounding (sums are reordered).
    with JobRunner(snapshot_policy="none", backend="gloo") as resumed:
        layout = resumed.start(spec, [GpuSlot("n", 1), GpuSlot("n", 0)], state=(saved, 1))
        assert layout.world_size == 2
        assert resumed.step_progress().step == 1
        _assert_same(resumed.gather_state(), saved)
        losses = first_losses + [loss for _, loss in resumed.train(2)]
        state = resumed.gather_state()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, tensor in ref_state.items():
        if name.startswith("param/"):
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=0.01 * 1e-3 * 3, msg=name)


def test_checkpoint_store_resumes_on_another_layout_and_ignores_other_workloads(
    tmp_path: Path,
) -> None:
    spec = job_spec_for(WORKLOAD, 2)
    store = CheckpointStore(tmp_path / "ckpt")
    assert store.latest(7, WORKLOAD) is None
    with JobRunner(snapshot_policy="none", backend="gloo") as first:
        first.start(spec, [GpuSlot("a", 0), GpuSlot("a", 1)])
        first.train(1)
        store.save(7, WORKLOAD, first)  # an older checkpoint: replaced by the next one
        first.train(1)
        saved = store.save(7, WORKLOAD, first)
        expected = first.gather_state()
    assert saved.step == 2
    job_dir = tmp_path / "ckpt" / "job-7"
    assert sorted(p.name for p in job_dir.iterdir()) == ["LATEST", "step-2"]

    found = store.latest(7, WORKLOAD)
    assert found is not None and found.step == 2 and found.layout == saved.layout
    # Another workload under the same job id (e.g. a reset database) is not resumed from.
    assert store.latest(7, WORKLOAD.model_copy(update={"seed": 99})) is None
    # A half-written checkpoint (no LATEST yet) is invisible.
    (tmp_path / "ckpt" / "job-8" / "step-1").mkdir(parents=True)
    assert store.latest(8, WORKLOAD) is None

    with JobRunner(snapshot_policy="none", backend="gloo") as loaded:
        loaded.start(spec, [GpuSlot("b", 0)], checkpoint=found.runtime_checkpoint())
        assert loaded.step_progress().step == 2
        _assert_same(loaded.gather_state(), expected)

    # The agent's job on another node (one slot, another layout) starts from the checkpoint.
    job = ManagedJob(7, WORKLOAD, spec, node="b", backend="gloo", checkpoints=store)
    with job.lock:
        job.start([0])
        job.pause()  # stops the driver and keeps the full state in memory
    assert job.resumed_from == "checkpoint@step2"
    assert job.paused is not None and job.paused.step >= 2
    ack = job.ack(1)
    assert ack.resumed_from == "checkpoint@step2" and ack.hot_switch is False
    with job.lock:
        job.stop("finished")
    assert not job_dir.exists()  # a finished job's checkpoints are removed


def test_a_move_resumes_on_the_new_node_from_the_checkpoint_its_pause_wrote(
    tmp_path: Path,
) -> None:
    # The scheduler moves a running job by a pause on its node, answered before the start on
    # the new node (`dispatch/service._decide_job`): the pause writes the checkpoint the new
    # node's start resumes from, at the step the pause stopped.
    spec = job_spec_for(WORKLOAD, 2)
    store = CheckpointStore(tmp_path / "ckpt")  # shared by both agents
    old = ManagedJob(9, WORKLOAD, spec, node="a", backend="gloo", checkpoints=store)
    with old.lock:
        old.start([0, 1])
    deadline = time.monotonic() + 60
    while old.step < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    with old.lock:
        old.pause()
    assert old.paused is not None
    paused_at = old.paused.step
    assert paused_at >= 2
    new = ManagedJob(9, WORKLOAD, spec, node="b", backend="gloo", checkpoints=store)
    try:
        with new.lock:
            new.start([0])
            new.pause()
        assert new.resumed_from == f"checkpoint@step{paused_at}"
        assert new.ack(3).resumed_from == f"checkpoint@step{paused_at}"
        assert new.paused is not None and new.paused.step >= paused_at
    finally:
        for job in (old, new):
            with job.lock:
                job.stop()
