"""Workers started by another node's worker host, on loopback (no namespaces needed).

The multi-node path (host spawns, worker dials back, plain-pickled socket channel) runs here in
every environment; `tests/multinode/` runs it across real interfaces where it can.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.hotswitch.test_switch import _reference
from worker_agent.protocol import worker_grant
from worker_agent.runtime.errors import WorkerFailed
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.remote import HostClient, WorkerHost
from worker_agent.runtime.runner import GpuSlot, JobRunner
from worker_agent.sharding import Layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SPEC = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)


@pytest.fixture
def host() -> Iterator[WorkerHost]:
    worker_host = WorkerHost("127.0.0.1", secrets.token_hex(16).encode())
    thread = threading.Thread(target=worker_host.serve_forever, daemon=True)
    thread.start()
    yield worker_host
    worker_host.close()
    thread.join(timeout=10)


def _client(host: WorkerHost, job_id: int, runner_node: str = "a") -> HostClient:
    """The client a runner on `runner_node` gets for `job_id` (the scheduler's grant)."""
    grant = worker_grant(host.secret.decode(), job_id, runner_node)
    return HostClient(("127.0.0.1", host.port), grant.encode(), job_id, runner_node)


def _runner(client: HostClient) -> JobRunner:
    return JobRunner(
        snapshot_policy="none", store_host="127.0.0.1", hosts={"b": client}, timeout_s=30
    )


def test_a_job_grows_onto_another_host_and_back_on_the_unswitched_trajectory(
    host: WorkerHost,
) -> None:
    ref_losses, _ = _reference(SPEC, 1, Layout(), 6)
    a0, b0 = GpuSlot("a", 0), GpuSlot("b", 0)
    with _runner(_client(host, 1)) as run:
        run.start(SPEC, [a0], Layout())
        losses = [loss for _, loss in run.train(2)]
        pid = run.worker_pids()[0]
        grow = run.resize([a0, b0], Layout(pp=2))
        assert grow.ok and [s.node for s in run.slots()] == ["a", "b"]
        assert grow.bytes_cross_node == grow.bytes_moved > 0
        assert grow.bytes_cross_node_min == grow.bytes_cross_node
        # Another job's valid grant on this host neither sees nor kills job 1's worker.
        remote_pid = run.worker_pids()[1]
        other = _client(host, 2)
        for request in ("alive", "kill"):
            with pytest.raises(OSError, match=f"pid {remote_pid} is not a worker of job 2"):
                other.request(request, pid=remote_pid)
        assert _client(host, 1).request("alive", pid=remote_pid) is True
        losses += [loss for _, loss in run.train(2)]
        shrink = run.resize([a0], Layout())
        assert shrink.ok and shrink.bytes_cross_node == shrink.bytes_moved > 0
        assert run.worker_pids() == [pid]
        losses += [loss for _, loss in run.train(2)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "client",
    [
        lambda host: HostClient(("127.0.0.1", host.port), b"not the key", 1, "a"),
        # A grant is scoped: job 2's, or job 1's for a runner on another node, opens nothing.
        lambda host: dataclasses.replace(_client(host, 2), job_id=1),
        lambda host: dataclasses.replace(_client(host, 1, runner_node="c"), runner_node="a"),
    ],
    ids=["wrong-key", "other-job", "other-runner-node"],
)
def test_a_host_refuses_a_runner_without_the_jobs_grant(
    host: WorkerHost, client: Callable[[WorkerHost], HostClient]
) -> None:
    with _runner(client(host)) as run:
        run.start(SPEC, [GpuSlot("a", 0)], Layout())
        with pytest.raises(WorkerFailed, match=r"node b: no worker started .*refused the key"):
            run.resize([GpuSlot("a", 0), GpuSlot("b", 0)], Layout(pp=2))
        # The job is untouched in its old layout.
        assert run.layout == Layout() and len(run.train(1)) == 1


def test_a_host_knows_its_workers_slots_and_jobs_and_refuses_what_its_agent_refuses(
    host: WorkerHost,
) -> None:
    def admit(slot: int | None, job: str | None) -> None:
        if slot == 1:
            raise ValueError("slot 1 of node b is held by job 9")

    host.admit = admit
    a0, b0, b1 = GpuSlot("a", 0), GpuSlot("b", 0), GpuSlot("b", 1)
    # The job a worker holds its slot for is the one its grant names (job 7's here).
    with _runner(_client(host, 7)) as run:
        run.start(SPEC, [a0], Layout())
        assert host.holdings() == {}
        run.resize([a0, b0], Layout(pp=2))
        assert host.holdings() == {0: "7"}
        with pytest.raises(WorkerFailed, match="held by job 9"):
            run.resize([a0, b1], Layout(pp=2))
        assert host.holdings() == {0: "7"} and run.layout == Layout(pp=2)
        run.resize([a0], Layout())
        # The released worker exits (interpreter teardown) shortly after the switch.
        deadline = time.monotonic() + 20
        while host.holdings() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert host.holdings() == {}
