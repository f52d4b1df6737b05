"""JobRunner as the agent drives it: background training, resize while running, progress."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from worker_agent.runtime.errors import LayoutError
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.runner import GpuSlot, JobRunner
from worker_agent.sharding import Layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _wait_for_step(run: JobRunner, step: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while run.step_progress().step < step:
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.05)


def test_resize_while_training_in_the_background() -> None:
    spec = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)
    with JobRunner() as run:
        run.start(spec, [GpuSlot("n0", 0), GpuSlot("n0", 1)], Layout(dp=2))
        run.run_background(steps_per_chunk=1)
        _wait_for_step(run, 2)
        pids = run.worker_pids()
        # Slot 1 is released, slots 2 and 3 are added; the chooser picks the 3-GPU layout.
        with pytest.raises(LayoutError, match="no layout"):
            run.resize([GpuSlot("n0", 0), GpuSlot("n0", 2), GpuSlot("n0", 3)])
        report = run.resize(
            [GpuSlot("n0", 0), GpuSlot("n0", 2), GpuSlot("n0", 3), GpuSlot("n0", 4)]
        )
        assert report.ok and report.dst.world_size == 4
        assert report.workers_released == [pids[1]] and len(report.workers_started) == 3
        assert pids[0] in run.worker_pids()
        step_at_switch = report.step
        _wait_for_step(run, step_at_switch + 2)
        progress = run.step_progress()
        assert progress.layout == report.dst
        assert progress.samples_per_s > 0 and progress.loss is not None
        assert sorted(run.worker_pids()) == sorted(progress.worker_pids)
        run.pause()
        stopped_at = run.step_progress().step
        time.sleep(0.2)
        assert run.step_progress().step == stopped_at


def test_start_from_checkpoint_or_state_reshards_exactly(tmp_path: Path) -> None:
    spec = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)
    with JobRunner(snapshot_policy="none") as run:
        run.start(spec, 2, Layout(tp=2))
        run.train(2)
        state = run.gather_state()
        ckpt = run.save_checkpoint(str(tmp_path))
    with JobRunner(snapshot_policy="none") as restarted:
        restarted.start(spec, 2, Layout(pp=2), checkpoint=ckpt)
        assert restarted.step_progress().step == 2
        got = restarted.gather_state()
        assert all(torch.equal(got[k], state[k]) for k in state)
        restarted.stop()
        restarted.start(spec, 1, Layout(), state=(state, 2))
        got = restarted.gather_state()
        assert all(torch.equal(got[k], state[k]) for k in state)
        assert restarted.train(1)[0][0] == 2


def test_same_workers_switch_while_training_builds_groups_before_the_pause() -> None:
    # Same slots, same ranks: the new layout's sub-groups form in the staging thread while the
    # training thread runs collectives on the old ones.
    spec = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)
    with JobRunner() as run:
        run.start(spec, 2, Layout(dp=2))
        run.run_background(steps_per_chunk=1)
        _wait_for_step(run, 2)
        pids = run.worker_pids()
        report = run.resize(2, Layout(tp=2))
        assert report.ok and report.regroup_s < report.switch_s
        assert run.worker_pids() == pids
        _wait_for_step(run, report.step + 2)
        report = run.resize(2, Layout(pp=2))
        assert report.ok and report.bytes_moved == report.bytes_lower_bound
        _wait_for_step(run, report.step + 2)
        progress = run.step_progress()
        assert progress.layout == Layout(pp=2) and progress.loss is not None
        assert torch.isfinite(torch.tensor(progress.loss))
        run.pause()


def test_plain_copy_probes_time_the_same_pairs() -> None:
    """The bench's references: a p2p copy and a shared-memory copy of the same pair bytes."""
    spec = JobSpec(preset="mlp", n_layers=1, d_model=8, global_batch_size=4, micro_batch_size=1)
    with JobRunner(snapshot_policy="none") as probe:
        probe.start(spec, 3, Layout(dp=3))
        pairs = [(0, 1, 1 << 20), (1, 0, 1 << 20), (2, 0, 4096)]
        assert probe.probe_p2p(pairs) > 0
        assert probe.probe_shm_copy(pairs) > 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)")
def test_repeated_switches_do_not_leak_file_descriptors() -> None:
    """Each switch between the same workers builds new sub-groups; the replaced ones must close."""
    spec = JobSpec(preset="gpt", n_layers=2, d_model=32, n_heads=4)
    with JobRunner() as run:
        run.start(spec, 2, Layout(tp=2))

        def open_fds() -> list[int]:
            run.train(1)  # the first command after a switch frees what it replaced
            return [len(os.listdir(f"/proc/{pid}/fd")) for pid in run.worker_pids()]

        for layout in (Layout(pp=2), Layout(tp=2)):
            run.resize(2, layout)
        before = open_fds()
        for _ in range(4):
            for layout in (Layout(pp=2), Layout(tp=2)):
                run.resize(2, layout)
        after = open_fds()
        # 8 more switches used to leave ~20 more descriptors per worker.
        assert all(a <= b + 2 for a, b in zip(after, before, strict=True)), (before, after)
