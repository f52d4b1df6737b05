"""A worker dying after every transfer finished (in the commit or the group rebuild) rolls back.

Each test trains, arms a fault in the window after the transfers, switches (growing or
shrinking), and checks: `SwitchFailed` with the expected `recovered_from`, the old layout, the
state bitwise equal to the state before the switch, no worker process left over, and training
that continues on the trajectory of a run that never switched (tolerances as in
tests/hotswitch/test_switch.py; in the old layout and from bitwise the same state the run is in
fact bit-identical).
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Literal

import pytest
import torch

from tests.hotswitch.test_switch import _assert_same_trajectory, _reference
from worker_agent.runtime.errors import SwitchFailed
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.runner import JobRunner, SwitchReport
from worker_agent.sharding import Layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SPEC = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)
BEFORE = 2
"""Steps before the switch."""
AFTER = 2
"""Steps after the failed switch."""
REGROUP_TIMEOUT_S = 20.0
"""A peer dying inside a rendezvous is noticed when the rendezvous times out (docs: limits)."""


def _children() -> set[int]:
    return {p.pid for p in mp.active_children() if p.pid is not None}


def _fail_after_transfers(
    gpus: int,
    layout: Layout,
    new_gpus: int,
    new_layout: Layout,
    rank: int,
    mode: Literal["commit", "regroup"],
    snapshot_policy: Literal["auto", "none"],
    recovered_from: str,
    timeout_s: float = 60.0,
) -> SwitchReport:
    """Run the failed switch and every check; returns the failed attempt's report."""
    ref_losses, ref_state = _reference(SPEC, gpus, layout, BEFORE + AFTER)
    base = _children()
    with JobRunner(snapshot_policy=snapshot_policy, timeout_s=timeout_s) as run:
        run.start(SPEC, gpus, layout)
        losses = [loss for _, loss in run.train(BEFORE)]
        before = run.gather_state()
        pids = run.worker_pids()
        run.arm_fault(rank=rank, mode=mode)
        with pytest.raises(SwitchFailed, match="rolled back") as info:
            run.resize(new_gpus, new_layout)
        assert info.value.recovered_from == recovered_from
        report = info.value.report
        assert report is not None
        assert not report.ok and report.recovered_from == recovered_from
        assert report.error is not None and "died" in report.error
        assert run.layout == layout and run.step_progress().step == BEFORE
        # The killed worker was replaced on its slot; every other worker kept its process.
        now = run.worker_pids()
        assert now[rank] != pids[rank]
        assert [p for r, p in enumerate(now) if r != rank] == [
            p for r, p in enumerate(pids) if r != rank
        ]
        # No process left over: the dead one was reaped, the joining ones were released.
        assert _children() - base == set(now)
        after = run.gather_state()
        assert before.keys() == after.keys()
        for name in before:
            assert torch.equal(before[name], after[name]), name
        losses += [loss for _, loss in run.train(AFTER)]
        _assert_same_trajectory(SPEC, losses, run.gather_state(), ref_losses, ref_state)
    assert _children() - base == set()
    return report


def test_worker_dying_in_commit_when_growing_is_rebuilt_from_its_replica() -> None:
    # dp2 -> dp2.tp2: the other old worker and both new ones commit; rank 1 dies.
    _fail_after_transfers(2, Layout(dp=2), 4, Layout(dp=2, tp=2), 1, "commit", "none", "replicas")


def test_worker_dying_in_commit_when_shrinking_restores_the_shared_state() -> None:
    # tp2.pp2 -> tp2: every shard is unique; under the default policy the dead worker's state
    # at the switch step is its shared-memory buffer, which the runner still maps.
    _fail_after_transfers(
        4, Layout(tp=2, pp=2), 2, Layout(tp=2), 0, "commit", "auto", f"snapshot@step{BEFORE}"
    )


def test_worker_dying_in_regroup_when_growing_restores_the_shared_state() -> None:
    # tp2 -> dp2.tp2: everyone committed; rank 1 dies when the new sub-groups form, its peers'
    # `new_group` fails at the rendezvous timeout, and the rollback finds no replica.
    _fail_after_transfers(
        2,
        Layout(tp=2),
        4,
        Layout(dp=2, tp=2),
        1,
        "regroup",
        "auto",
        f"snapshot@step{BEFORE}",
        timeout_s=REGROUP_TIMEOUT_S,
    )


def test_worker_dying_in_regroup_when_shrinking_is_rebuilt_from_a_replica() -> None:
    # dp4 -> dp2: the survivors committed and form a new generation; rank 0 dies in that
    # rendezvous; the leavers, committed as leaving, take their old state back.
    report = _fail_after_transfers(
        4,
        Layout(dp=4),
        2,
        Layout(dp=2),
        0,
        "regroup",
        "none",
        "replicas",
        timeout_s=REGROUP_TIMEOUT_S,
    )
    assert report.workers_released == []


def test_job_switches_again_after_a_failed_commit() -> None:
    with JobRunner() as run:
        run.start(SPEC, 2, Layout(tp=2))
        run.train(1)
        before = run.gather_state()
        run.arm_fault(rank=0, mode="commit")
        with pytest.raises(SwitchFailed):
            run.resize(4, Layout(tp=2, dp=2))
        report = run.resize(4, Layout(tp=2, dp=2))
        assert report.ok and run.layout == Layout(tp=2, dp=2)
        assert report.bytes_moved == report.bytes_lower_bound
        after = run.gather_state()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert run.train(1)[0][0] == 1
