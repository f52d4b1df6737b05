"""A worker that dies in the middle of a switch: the job rolls back and stays consistent."""

from __future__ import annotations

import pytest
import torch

from worker_agent.runtime.errors import SwitchFailed
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.runner import JobRunner
from worker_agent.sharding import Layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SPEC = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)


def _assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_dead_replica_is_rebuilt_from_its_peer() -> None:
    with JobRunner(snapshot_policy="none") as run, JobRunner(snapshot_policy="none") as ref:
        run.start(SPEC, 2, Layout(dp=2))
        ref.start(SPEC, 2, Layout(dp=2))
        run.train(2)
        ref.train(2)
        before = run.gather_state()
        pids = run.worker_pids()
        run.arm_fault(rank=1)
        with pytest.raises(SwitchFailed, match="rolled back") as info:
            run.resize(4, Layout(dp=2, tp=2))
        assert info.value.recovered_from == "replicas"
        assert run.layout == Layout(dp=2)
        new_pids = run.worker_pids()
        assert new_pids[0] == pids[0] and new_pids[1] != pids[1]
        _assert_state_equal(before, run.gather_state())
        # Training continues on the same trajectory as a run that never tried to switch.
        assert run.train(2) == ref.train(2)
        _assert_state_equal(ref.gather_state(), run.gather_state())


def test_dead_unique_shard_is_restored_from_the_snapshot() -> None:
    with JobRunner(snapshot_policy="before_switch") as run:
        run.start(SPEC, 2, Layout(tp=2))
        run.train(2)
        before = run.gather_state()
        run.arm_fault(rank=0)
        with pytest.raises(SwitchFailed) as info:
            run.resize(4, Layout(dp=2, tp=2))
        assert info.value.recovered_from == "snapshot@step2"
        assert run.layout == Layout(tp=2)
        assert run.step_progress().step == 2
        _assert_state_equal(before, run.gather_state())
        losses = run.train(1)
        assert losses[0][0] == 2 and torch.isfinite(torch.tensor(losses[0][1]))
        # The job can still switch after a failed attempt.
        report = run.resize(2, Layout(dp=2))
        assert report.ok and report.bytes_moved == report.bytes_lower_bound


def test_unique_state_without_snapshot_is_reported_lost() -> None:
    with JobRunner(snapshot_policy="none") as run:
        run.start(SPEC, 2, Layout(pp=2))
        run.arm_fault(rank=1)
        with pytest.raises(Exception, match="lost"):
            run.resize(2, Layout(dp=2))


def test_failed_transfer_keeps_every_worker_in_the_old_layout() -> None:
    with JobRunner(snapshot_policy="none", timeout_s=30) as run:
        run.start(SPEC, 2, Layout(tp=2))
        run.train(1)
        before = run.gather_state()
        pids = run.worker_pids()
        run.arm_fault(rank=0, mode="transfer")
        with pytest.raises(SwitchFailed, match="injected transfer failure") as info:
            run.resize(2, Layout(pp=2))
        assert info.value.recovered_from == "old-layout"
        assert run.layout == Layout(tp=2) and run.worker_pids() == pids
        _assert_state_equal(before, run.gather_state())
        # The fault fired once; the next attempt succeeds and moves exactly the lower bound.
        report = run.resize(2, Layout(pp=2))
        assert report.ok and report.bytes_moved == report.bytes_lower_bound
        _assert_state_equal(before, run.gather_state())


def test_default_policy_restores_a_dead_unique_shard_without_a_snapshot_copy() -> None:
    # CPU workers keep their state in shared memory the runner maps: nothing is copied at the
    # switch, yet the dead worker's state at the switch step survives it.
    with JobRunner() as run:
        run.start(SPEC, 2, Layout(tp=2))
        run.train(2)
        before = run.gather_state()
        run.arm_fault(rank=1)
        with pytest.raises(SwitchFailed) as info:
            run.resize(2, Layout(pp=2))
        assert info.value.recovered_from == "snapshot@step2"
        report = info.value.report
        assert report is not None
        assert report.snapshot_s == 0.0
        assert run.layout == Layout(tp=2) and run.step_progress().step == 2
        _assert_state_equal(before, run.gather_state())
        report = run.resize(2, Layout(pp=2))
        assert report.ok and report.snapshot_s == 0.0
        _assert_state_equal(before, run.gather_state())


def test_periodic_snapshot_is_the_fallback_and_costs_the_switch_nothing() -> None:
    with JobRunner(snapshot_policy="periodic", snapshot_every_steps=2) as run:
        run.start(SPEC, 2, Layout(tp=2))
        run.train(1)  # first chunk: snapshot at step 1
        run.train(1)
        run.train(1)  # step 3: two steps since the last one, snapshot at step 3
        at_3 = run.gather_state()
        run.train(1)
        run.arm_fault(rank=0)
        with pytest.raises(SwitchFailed) as info:
            run.resize(2, Layout(pp=2))
        assert info.value.recovered_from == "snapshot@step3"
        assert info.value.report is not None and info.value.report.snapshot_s == 0.0
        assert run.layout == Layout(tp=2) and run.step_progress().step == 3
        _assert_state_equal(at_3, run.gather_state())
        assert run.train(1)[0][0] == 3


def test_worker_dying_while_staging_rolls_back_before_anything_moved() -> None:
    # Staging runs before the pause; a worker lost there is met by the paused part of the switch
    # (its commands fail), which rolls back and rebuilds the replica from its peer.
    with JobRunner(snapshot_policy="none") as run, JobRunner(snapshot_policy="none") as ref:
        run.start(SPEC, 2, Layout(dp=2))
        ref.start(SPEC, 2, Layout(dp=2))
        run.train(1)
        ref.train(1)
        before = run.gather_state()
        pids = run.worker_pids()
        run.arm_fault(rank=1, mode="stage")
        with pytest.raises(SwitchFailed) as info:
            run.resize(4, Layout(dp=2, tp=2))
        assert info.value.recovered_from == "replicas"
        assert run.layout == Layout(dp=2) and run.worker_pids()[0] == pids[0]
        _assert_state_equal(before, run.gather_state())
        assert run.train(1) == ref.train(1)
        report = run.resize(4, Layout(dp=2, tp=2))
        assert report.ok and report.bytes_moved == report.bytes_lower_bound
