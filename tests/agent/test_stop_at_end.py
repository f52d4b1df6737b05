"""A stop that reaches the agent after its job trained every sample but before the agent's
monitor noticed (the scheduler counts the last samples from telemetry and stops the job) must
end the job as finished, export included, not throw the trained model away."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from worker_agent.agent import Agent, AgentConfig
from worker_agent.protocol import AllocationCommand, GpuSlotInfo, StopCommand, WorkloadSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

JOB = """
import torch


def job():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return {
        "model": lambda: torch.nn.Linear(4, 1),
        "dataset": torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)),
        "loss": lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
        "optimizer": {"name": "sgd", "lr": 0.01},
    }
"""


@pytest.mark.parametrize("how", ["stop command", "heartbeat stop list"])
def test_a_stop_for_a_job_that_trained_everything_still_exports_it(
    tmp_path: Path, how: str
) -> None:
    # The job's workdir bundle, already in the agent's cache (so no scheduler is asked for it).
    sha = "ab" * 32
    code = tmp_path / "agent" / "bundles" / sha
    code.mkdir(parents=True)
    (code / "stop_end_job.py").write_text(JOB)
    config = AgentConfig(
        # Never contacted: no background thread runs, so the monitor never ends the job itself.
        scheduler_url="http://127.0.0.1:9",
        token="unused",
        name="node-1",
        slots=[GpuSlotInfo(index=0)],
        data_dir=tmp_path / "agent",
        rapl_root=None,
    )
    agent = Agent(config)
    try:
        spec = WorkloadSpec.model_validate(
            {
                "workload": "stop_end_job:job",
                "bundle_sha256": sha,
                "global_batch_size": 8,
                "total_samples": 8 * 6,
            }
        )
        ack = agent.apply_allocation(
            AllocationCommand(
                job_id=1, generation=1, slot_indices=[0], spec=spec, issued_at=datetime.now(UTC)
            )
        )
        assert ack.gpus == 1
        job = agent._jobs[1]  # the monitor's own view of the job
        deadline = time.monotonic() + 120
        while not job.reached_end():
            assert time.monotonic() < deadline, f"the job stayed at step {job.step}"
            time.sleep(0.2)

        if how == "stop command":
            stopped = agent.stop_job(StopCommand(job_id=1, generation=2, reason="job is SUCCEEDED"))
            assert stopped.gpus == 0 and stopped.step == 6
        else:
            agent.stop_unwanted(1)  # a heartbeat's answer names the job, now SUCCEEDED

        assert job.state == "finished"
        export = tmp_path / "agent" / "exports" / "job-1"
        assert (export / "greenflow.json").is_file() and (export / "model.safetensors").is_file()
        # The last telemetry sample says the job finished, as the monitor's would.
        samples = agent.outbox.peek(len(agent.outbox))
        assert samples and samples[-1].finished and samples[-1].samples_done == 8 * 6
    finally:
        agent.shutdown()
