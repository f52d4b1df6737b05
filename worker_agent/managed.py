"""One job as the agent manages it: start, hot-switch, pause to memory, resume, finish, stop.

The agent serialises commands per job (`ManagedJob.lock`); training itself runs in the runtime's
background driver thread, so a resize overlaps worker start-up with training.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import torch

from worker_agent.checkpoints import CheckpointStore
from worker_agent.protocol import (
    AllocationAck,
    PowerSource,
    RunningJob,
    TelemetrySample,
    WorkloadSpec,
)
from worker_agent.runtime.errors import WorkerFailed
from worker_agent.runtime.pool import GpuSlot, JobRunner, SwitchReport
from worker_agent.runtime.presets import JobSpec
from worker_agent.telemetry import energy_kwh, estimated_power_w
from worker_agent.workloads import total_steps

log = logging.getLogger(__name__)

JobState = Literal["idle", "running", "paused", "finished", "stopped", "failed"]

# (job, interval_s, busy_fraction) -> (power_w, energy_kwh, source) for the interval just closed.
PowerReader = Callable[["ManagedJob", float, float], tuple[float, float, PowerSource]]

MIN_SAMPLE_INTERVAL_S = 0.05
"""Shorter intervals are not cut into a sample of their own (they join the next one)."""


def short_error(message: str, limit: int = 500) -> str:
    """A worker error without its tracebacks, short enough for a heartbeat."""
    lines = [
        line.strip()
        for line in message.splitlines()
        if line.strip() and not line.startswith((" ", "Traceback"))
    ]
    return " ".join(lines)[:limit]


@dataclass
class PausedState:
    """A paused job's full training state, kept in agent memory."""

    state: dict[str, torch.Tensor]
    step: int
    loss: float | None


class ManagedJob:
    """A job's runner, allocation, pause snapshot and telemetry accounting."""

    def __init__(
        self,
        job_id: int,
        spec: WorkloadSpec,
        job_spec: JobSpec,
        node: str,
        backend: str | None,
        power_reader: PowerReader | None = None,
        checkpoints: CheckpointStore | None = None,
        checkpoint_interval_s: float = 300.0,
    ) -> None:
        self.job_id = job_id
        self.spec = spec
        self.job_spec = job_spec
        self.node = node
        self.backend = backend
        self.total_steps = total_steps(spec)
        self.lock = threading.RLock()
        self.state: JobState = "idle"
        self.generation = 0
        self.last_ack: AllocationAck | None = None
        self.slot_indices: list[int] = []
        self.runner: JobRunner | None = None
        self.paused: PausedState | None = None
        self.error: str | None = None
        self.estimated_power_w: dict[int, float] = {}
        self._last_step = 0
        self._last_loss: float | None = None
        # Telemetry accounting: busy = time the background driver was training.
        self._busy_acc_s = 0.0
        self._run_since: float | None = None
        self._sample_at = time.monotonic()
        self._sample_busy_s = 0.0
        self._sample_step = 0
        self._power_reader = power_reader
        self.checkpoints = checkpoints
        self.checkpoint_interval_s = checkpoint_interval_s
        self._checkpoint_at = time.monotonic()
        self.resumed_from = "start"
        """Where the current run's state came from: start, memory, or checkpoint@step<N>."""

    # ----- views ----------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps done."""
        if self.runner is not None and self.state == "running":
            with contextlib.suppress(WorkerFailed, RuntimeError):
                self._last_step = self.runner.step_progress().step
        elif self.paused is not None:
            self._last_step = self.paused.step
        return self._last_step

    def samples_done(self, step: int | None = None) -> int:
        """Samples trained so far (step x global batch), capped at the job's total."""
        s = self.step if step is None else step
        return min(s * self.spec.global_batch_size, max(self.spec.total_samples, 0))

    def layout(self) -> str | None:
        """Current layout as 'dp{d}-tp{t}-pp{p}', None when no workers run."""
        if self.runner is None or self.state != "running":
            return None
        return str(self.runner.layout)

    def worker_pids(self) -> list[int]:
        """Worker process ids by rank."""
        if self.runner is None or self.state != "running":
            return []
        return self.runner.worker_pids()

    def running_job(self) -> RunningJob:
        """The job as the heartbeat and /status report it."""
        step = self.step
        return RunningJob(
            job_id=self.job_id,
            generation=self.generation,
            gpus=len(self.slot_indices),
            slot_indices=list(self.slot_indices),
            layout=self.layout(),
            step=step,
            samples_done=self.samples_done(step),
            worker_pids=self.worker_pids(),
            finished=self.state == "finished",
            error=self.error,
        )

    def ack(self, generation: int, report: SwitchReport | None = None) -> AllocationAck:
        """The acknowledgement of the command that produced the current allocation."""
        return AllocationAck(
            job_id=self.job_id,
            generation=generation,
            gpus=len(self.slot_indices),
            layout=self.layout(),
            step=self.step,
            worker_pids=self.worker_pids(),
            hot_switch=report is not None,
            switch_s=None if report is None else report.switch_s,
            bytes_moved=None if report is None else report.bytes_moved,
            resumed_from=None if report is not None else self.resumed_from,
        )

    # ----- commands (caller holds self.lock) ------------------------------------------------
    def start(self, slots: list[int]) -> None:
        """Start from the pause snapshot (state paused), else the newest checkpoint, else fresh."""
        runner = JobRunner(snapshot_policy="auto", backend=self.backend)
        gpu_slots = [GpuSlot(self.node, i) for i in slots]
        stored = None
        if self.paused is None and self.checkpoints is not None:
            stored = self.checkpoints.latest(self.job_id, self.spec)
        try:
            if self.paused is not None:
                runner.start(self.job_spec, gpu_slots, state=(self.paused.state, self.paused.step))
                self.resumed_from = "memory"
            elif stored is not None:
                runner.start(self.job_spec, gpu_slots, checkpoint=stored.runtime_checkpoint())
                self.resumed_from = f"checkpoint@step{stored.step}"
                self._last_step = stored.step
            else:
                runner.start(self.job_spec, gpu_slots)
                self.resumed_from = "start"
        except BaseException:
            runner.stop()
            raise
        self.runner = runner
        self.slot_indices = list(slots)
        if self.paused is not None:
            self._last_loss = self.paused.loss
        self.paused = None
        self.state = "running"
        self._sample_at = time.monotonic()
        self._sample_busy_s = self._busy_acc_s
        self._sample_step = self.step
        self._checkpoint_at = time.monotonic()
        self._run()

    def maybe_checkpoint(self, now: float) -> bool:
        """Save a checkpoint when the interval has passed (training pauses while it writes)."""
        if (
            self.checkpoints is None
            or self.state != "running"
            or self.runner is None
            or now - self._checkpoint_at < self.checkpoint_interval_s
        ):
            return False
        self._halt()
        try:
            saved = self.checkpoints.save(self.job_id, self.spec, self.runner)
            log.info("job %d: checkpoint at step %d", self.job_id, saved.step)
        except OSError as exc:  # storage trouble must not stop training; the next try may work
            log.warning("job %d: checkpoint failed: %s", self.job_id, exc)
        finally:
            self._checkpoint_at = time.monotonic()
            self._run()
        return True

    def resize(self, slots: list[int]) -> tuple[SwitchReport, TelemetrySample | None]:
        """Hot-switch the running job onto `slots` (kept slots keep their worker process).

        Also returns the telemetry sample of the time the resize took: the job trained in its old
        layout while the new workers started, so that sample carries the old GPU count.
        """
        assert self.runner is not None
        old_gpus, old_layout = len(self.slot_indices), str(self.runner.layout)
        report = self.runner.resize([GpuSlot(self.node, i) for i in slots])
        self.slot_indices = [s.index for s in self.runner.slots()]
        # The driver waited while the switch ran: that time was not training.
        self._busy_acc_s -= report.switch_s
        return report, self.cut_sample(gpus=old_gpus, layout=old_layout)

    def pause(self) -> None:
        """Snapshot the full state into memory and release every worker."""
        assert self.runner is not None
        runner = self.runner
        self._halt()
        step = runner.step_progress().step
        loss = runner.step_progress().loss
        state = runner.gather_state()
        if self.checkpoints is not None:
            # The snapshot lives in this agent's memory; the checkpoint lets another node resume.
            try:
                self.checkpoints.save(self.job_id, self.spec, runner)
            except OSError as exc:
                log.warning("job %d: checkpoint at pause failed: %s", self.job_id, exc)
        self.paused = PausedState(state, step, loss)
        self._last_step = step
        runner.stop()
        self.runner = None
        self.slot_indices = []
        self.state = "paused"

    def stop(self, final_state: JobState = "stopped") -> None:
        """Stop training for good and release every worker."""
        if self.runner is not None:
            with contextlib.suppress(WorkerFailed, RuntimeError):
                self._last_step = self.runner.step_progress().step
            # A failed driver must not keep the workers alive: stop() releases them regardless.
            with contextlib.suppress(WorkerFailed):
                self._halt()
            self.runner.stop()
            self.runner = None
        self.paused = None
        self.slot_indices = []
        self.state = final_state
        if self.checkpoints is not None and final_state == "finished":
            # Only a finished job's checkpoints are surely unneeded: a stopped one may be
            # resuming on another node from them right now.
            self.checkpoints.remove(self.job_id)

    def fail(self, message: str) -> None:
        """Record a worker failure and release whatever is left of the job's workers."""
        self.error = short_error(message)
        if self.runner is not None:
            with contextlib.suppress(WorkerFailed):
                self._halt()
            try:
                self.runner.stop()
            except Exception as exc:  # the workers are already broken; freeing them is best effort
                log.warning("job %d: stopping failed workers: %s", self.job_id, exc)
            self.runner = None
        self.slot_indices = []
        self.state = "failed"

    def reached_end(self) -> bool:
        """Whether the running job has trained all its samples."""
        return self.state == "running" and self.step >= self.total_steps

    # ----- telemetry ------------------------------------------------------------------------
    def busy_s(self, now: float) -> float:
        """Seconds the workers spent training since the job was created."""
        running = 0.0 if self._run_since is None else now - self._run_since
        return self._busy_acc_s + running

    def cut_sample(
        self, finished: bool = False, gpus: int | None = None, layout: str | None = None
    ) -> TelemetrySample | None:
        """Close the current telemetry interval of a running job into one sample.

        `gpus`/`layout` label the interval when it ran on another allocation than the current one.
        """
        if self.runner is None or self.state != "running":
            return None
        now = time.monotonic()
        at = datetime.now(UTC)  # read together with `now` so `at` differences match intervals
        interval_s = now - self._sample_at
        if interval_s < MIN_SAMPLE_INTERVAL_S and not finished:
            return None
        interval_s = max(interval_s, 1e-3)
        busy_fraction = (self.busy_s(now) - self._sample_busy_s) / interval_s
        try:
            progress = self.runner.step_progress()
        except WorkerFailed:
            return None
        if gpus is None:
            gpus = len(self.slot_indices)
        source: PowerSource = "estimated"
        if self._power_reader is not None:
            power_w, energy, source = self._power_reader(self, interval_s, busy_fraction)
        else:
            power_w = estimated_power_w(self.estimated_power_w, gpus, busy_fraction)
            energy = energy_kwh(power_w, interval_s)
        steps = progress.step - self._sample_step
        sample = TelemetrySample(
            sample_id=uuid.uuid4().hex,
            job_id=self.job_id,
            generation=self.generation,
            at=at,
            interval_s=min(interval_s, 86_400.0),
            step=progress.step,
            samples_done=self.samples_done(progress.step),
            samples_per_s=max(0.0, steps * self.spec.global_batch_size / interval_s),
            loss=progress.loss if progress.loss is not None else self._last_loss,
            gpus=gpus,
            layout=layout or str(progress.layout),
            power_w=power_w,
            energy_kwh=energy,
            power_source=source,
            finished=finished,
        )
        self._sample_at = now
        self._sample_busy_s = self.busy_s(now)
        self._sample_step = progress.step
        return sample

    # ----- internals ------------------------------------------------------------------------
    def _run(self) -> None:
        assert self.runner is not None
        self.runner.run_background(steps_per_chunk=1, max_steps=self.total_steps)
        self._run_since = time.monotonic()

    def _halt(self) -> None:
        """Stop the background driver (the workers stay up)."""
        assert self.runner is not None
        if self._run_since is not None:
            self._busy_acc_s += time.monotonic() - self._run_since
            self._run_since = None
        self.runner.pause()
