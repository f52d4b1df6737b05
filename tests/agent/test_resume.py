"""Pause to memory and resume: the resumed workers hold exactly the saved state and training
continues on the same trajectory, through the runtime's start_from_state (when present) and
through the agent's own fallback over the workers' restore command.
"""

from __future__ import annotations

import pytest
import torch

from worker_agent.managed import ResumableJobRunner
from worker_agent.protocol import WorkloadSpec
from worker_agent.runtime.pool import GpuSlot, JobRunner
from worker_agent.workloads import job_spec_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_resume_restores_state_and_trajectory() -> None:
    spec = job_spec_for(WorkloadSpec(workload="gpt-tiny", global_batch_size=8, total_samples=64), 2)
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
    resumed = ResumableJobRunner(snapshot_policy="none", backend="gloo")
    with resumed:
        layout = resumed.resume_from(spec, [GpuSlot("n", 1), GpuSlot("n", 0)], saved, 1)
        assert layout.world_size == 2
        assert resumed.step_progress().step == 1
        restored = resumed.gather_state()
        assert restored.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(restored[name], tensor), name
        losses = first_losses + [loss for _, loss in resumed.train(2)]
        state = resumed.gather_state()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, tensor in ref_state.items():
        if name.startswith("param/"):
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=0.01 * 1e-3 * 3, msg=name)

    # The agent's fallback path on the same layout as the reference: nothing changes at all.
    fallback = ResumableJobRunner(snapshot_policy="none", backend="gloo")
    with fallback:
        fallback.resume_from(spec, [GpuSlot("n", 0)], saved, 1, native=False)
        assert fallback.step_progress().step == 1
        losses = first_losses + [loss for _, loss in fallback.train(2)]
        state = fallback.gather_state()
    assert losses == ref_losses
    for name, tensor in ref_state.items():
        assert torch.equal(state[name], tensor), name
