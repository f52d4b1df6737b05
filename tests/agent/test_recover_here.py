"""A job across two nodes whose workers on the other node die goes on on its runner's node
alone, from the survivors' replicas (no step lost), and says which node it lost (issue 20).

Both "nodes" are on loopback here: the agent (node-a, with a rendezvous address) and a second
node's worker host (node-b), as in tests/runtime/test_remote.py; tests/multinode/ runs agents
across real interfaces."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.runtime.test_remote import host  # noqa: F401 (fixture: node-b's worker host)
from worker_agent.agent import Agent, AgentConfig
from worker_agent.protocol import (
    AllocationCommand,
    GpuSlotInfo,
    RemotePart,
    WorkloadSpec,
    worker_grant,
)
from worker_agent.runtime.remote import WorkerHost
from worker_agent.runtime.runner import JobRunner
from worker_agent.sharding import Layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _wait(what: str, condition: object, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_job_that_loses_its_other_node_goes_on_here_from_its_replicas(
    tmp_path: Path,
    host: WorkerHost,  # noqa: F811 (fixture)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Replicas exist only under data parallelism; for the tiny presets the layout chooser
    # prefers pipelining across nodes (no replica: the scheduler's checkpoint path applies), so
    # this test asks for data parallelism, as a compute-heavy model's choice would be.
    monkeypatch.setattr(JobRunner, "_choose", lambda self, gpus: Layout(dp=gpus))
    node_b = host
    agent = Agent(
        AgentConfig(
            scheduler_url="http://127.0.0.1:9",  # never contacted: no background loop runs
            token="unused",
            name="node-a",
            slots=[GpuSlotInfo(index=0)],
            data_dir=tmp_path / "agent",
            rapl_root=None,
            rendezvous_host="127.0.0.1",
        )
    )
    try:
        spec = WorkloadSpec(workload="mlp", global_batch_size=16, total_samples=16 * 100_000)
        part = RemotePart(
            node="node-b",
            host="127.0.0.1",
            port=node_b.port,
            slot_indices=[0],
            grant=worker_grant(node_b.secret.decode(), 1, "node-a"),
        )
        ack = agent.apply_allocation(
            AllocationCommand(
                job_id=1,
                generation=1,
                slot_indices=[0],
                remote=[part],
                spec=spec,
                issued_at=datetime.now(UTC),
            )
        )
        assert ack.gpus == 2 and ack.layout is not None and ack.layout.startswith("dp2"), ack
        job = agent._jobs[1]  # the monitor's own view of the job
        assert job.runner is not None
        here, there = job.runner.worker_pids()
        _wait("training on both nodes", lambda: job.step >= 5)
        os.kill(there, signal.SIGKILL)  # node-b's worker: its node is gone

        def checked() -> bool:
            with job.lock:
                agent._check_job(job)  # what the monitor loop does every 0.2 s
            return bool(job.lost_nodes) or job.state != "running"

        _wait("the loss noticed", checked)
        assert job.state == "running", job.error
        reported = job.running_job()
        assert reported.lost_nodes == ["node-b"]
        assert reported.gpus == 1 and reported.slot_indices == [0]
        assert reported.worker_pids == [here]  # the surviving worker goes on, not a new one
        step_at_loss = reported.step
        _wait("training on alone", lambda: job.step > step_at_loss + 3)
        assert job.error is None
    finally:
        agent.shutdown()
