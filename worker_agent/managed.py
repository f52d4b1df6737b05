"""One job as the agent manages it: start, hot-switch, pause to memory, resume, finish, stop.

The agent serialises commands per job (`ManagedJob.lock`); training itself runs in the runtime's
background driver thread, so a resize overlaps worker start-up with training.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import torch

from worker_agent.checkpoints import CheckpointStore
from worker_agent.logstore import record_ranks
from worker_agent.protocol import (
    AllocationAck,
    PowerSource,
    RemotePart,
    RunningJob,
    TelemetrySample,
    WorkloadSpec,
)
from worker_agent.runtime.errors import JobCodeFailed, JobSpecError, WorkerFailed
from worker_agent.runtime.module_job import ModelInfo
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.remote import HostClient
from worker_agent.runtime.runner import GpuSlot, JobRunner, RecoveryReport, SwitchReport
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


@dataclass(frozen=True)
class ClusterAccess:
    """How this node's jobs reach other nodes: the address they reach it on (each part's grant
    comes with the command that names it)."""

    rendezvous_host: str


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
        log_dir: Path | None = None,
        cluster: ClusterAccess | None = None,
        export_root: Path | None = None,
    ) -> None:
        self.job_id = job_id
        self.export_root = export_root
        """The agent's export directory: where `init_from: job:<id>` finds `job-<id>/`."""
        self.cluster = cluster
        """Set: the job's runner can take workers on other nodes (its store on the node's
        rendezvous address); None: the job runs inside this node only."""
        self.remote: list[RemotePart] = []
        """The job's slots on other nodes (their workers run under those nodes' worker hosts)."""
        self.lost_nodes: list[str] = []
        """Nodes the job lost its workers on and now runs without (`recover_here`)."""
        self.log_dir = log_dir
        """The workers' captured output (worker_agent/logstore.py); None: not captured."""
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
        self.start_step = 0
        """The step the current run started at (0, the pause's or the checkpoint's)."""
        self.exported_to: Path | None = None
        """Where the finished job's result was exported."""
        self.job_error = False
        """Whether the failure (`error`) is the job's own code's: the scheduler fails the job."""
        self.model_info: ModelInfo | None = None
        """Module jobs: the model's geometry from the first start (a resume need not rebuild it)."""
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

    @property
    def gpus(self) -> int:
        """GPUs the job holds, on this node and others."""
        return len(self.slot_indices) + sum(len(p.slot_indices) for p in self.remote)

    def running_job(self) -> RunningJob:
        """The job as the heartbeat and /status report it."""
        step = self.step
        return RunningJob(
            job_id=self.job_id,
            generation=self.generation,
            gpus=self.gpus,
            slot_indices=list(self.slot_indices),
            layout=self.layout(),
            step=step,
            samples_done=self.samples_done(step),
            worker_pids=self.worker_pids(),
            finished=self.state == "finished",
            error=self.error,
            job_error=self.job_error,
            lost_nodes=list(self.lost_nodes),
        )

    def ack(
        self,
        generation: int,
        report: SwitchReport | None = None,
        *,
        started: bool = True,
        at_step: int | None = None,
    ) -> AllocationAck:
        """The acknowledgement of the command that produced the current allocation (`started`:
        that command started the run, rather than finding it already on these slots; `at_step`:
        the step to report instead of the progress now, e.g. where a start began)."""
        return AllocationAck(
            job_id=self.job_id,
            generation=generation,
            gpus=self.gpus,
            layout=self.layout(),
            step=self.step if at_step is None else at_step,
            worker_pids=self.worker_pids(),
            hot_switch=report is not None,
            switch_s=None if report is None else report.switch_s,
            bytes_moved=None if report is None else report.bytes_moved,
            resumed_from=self.resumed_from if report is None and started else None,
        )

    # ----- commands (caller holds self.lock) ------------------------------------------------
    def _new_runner(self) -> JobRunner:
        if self.cluster is None:
            return JobRunner(snapshot_policy="auto", backend=self.backend, log_dir=self.log_dir)
        return JobRunner(
            snapshot_policy="auto",
            backend=self.backend,
            log_dir=self.log_dir,
            store_host=self.cluster.rendezvous_host,
            remote_ready=True,
        )

    def _gpu_slots(
        self, runner: JobRunner, slots: list[int], remote: list[RemotePart]
    ) -> tuple[list[GpuSlot], int | None]:
        """The runtime's slots (this node's first, then each other node's) and the TP bound:
        the GPUs every node's part is a multiple of (None inside one node)."""
        if remote and self.cluster is None:
            raise ValueError(
                f"job {self.job_id}: slots on other nodes need a rendezvous address on this "
                "node (--rendezvous-host)"
            )
        if remote and not slots:
            raise ValueError(f"job {self.job_id}: a job across nodes needs slots on its own node")
        out = [GpuSlot(self.node, i) for i in slots]
        for part in remote:
            if part.node == self.node:
                raise ValueError(f"job {self.job_id}: remote part names this node {part.node}")
            runner.hosts[part.node] = HostClient(
                (part.host, part.port), part.grant.encode(), self.job_id, self.node
            )
            out += [GpuSlot(part.node, i) for i in part.slot_indices]
        if not remote:
            return out, None
        return out, math.gcd(len(slots), *(len(p.slot_indices) for p in remote))

    def _init_source(self) -> Path:
        """Where the job's `init_from` weights are on this node (JobCodeFailed if absent)."""
        name = self.spec.init_from or ""
        if name.startswith("job:"):
            if self.export_root is None:
                raise JobCodeFailed(f"init_from {name}: this agent keeps no exports")
            path = self.export_root / f"job-{name[4:]}"
        else:
            path = Path(name)
        weights = path if path.is_file() else path / "model.safetensors"
        if not weights.is_file():
            raise JobCodeFailed(
                f"init_from {name}: no {weights} on node {self.node} (a job's export stays on "
                "the node that ran it, unless --export-dir is shared storage)"
            )
        return path

    def start(self, slots: list[int], remote: list[RemotePart] | None = None) -> None:
        """Start from the pause snapshot (state paused), else the newest checkpoint, else fresh."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        remote = list(remote or [])
        runner = self._new_runner()
        gpu_slots, per_node = self._gpu_slots(runner, slots, remote)
        stored = None
        if self.paused is None and self.checkpoints is not None:
            stored = self.checkpoints.latest(self.job_id, self.spec)
        try:
            if self.paused is not None:
                runner.start(
                    self.job_spec,
                    gpu_slots,
                    state=(self.paused.state, self.paused.step),
                    model_info=self.model_info,
                    gpus_per_node=per_node,
                )
                self.resumed_from = "memory"
            elif stored is not None:
                runner.start(
                    self.job_spec,
                    gpu_slots,
                    checkpoint=stored.runtime_checkpoint(),
                    model_info=self.model_info,
                    gpus_per_node=per_node,
                )
                self.resumed_from = f"checkpoint@step{stored.step}"
                self._last_step = stored.step
            elif self.spec.init_from is not None:
                source = self._init_source()
                try:
                    runner.start(
                        self.job_spec,
                        gpu_slots,
                        gpus_per_node=per_node,
                        init_from=source,
                        init_weights_only=True,
                    )
                except JobSpecError as exc:
                    # The weights do not fit the job's model: the job's own fault, for good.
                    raise JobCodeFailed(f"init_from {self.spec.init_from}: {exc}") from exc
                self.resumed_from = f"the weights of {self.spec.init_from}"
            else:
                runner.start(self.job_spec, gpu_slots, gpus_per_node=per_node)
                self.resumed_from = "start"
        except BaseException:
            runner.stop()
            raise
        self.runner = runner
        self.model_info = runner.model_info
        self.slot_indices = list(slots)
        self.remote = remote
        self._record_ranks()
        if self.paused is not None:
            self._last_loss = self.paused.loss
        self.paused = None
        self.state = "running"
        self._sample_at = time.monotonic()
        self._sample_busy_s = self._busy_acc_s
        self._sample_step = self.step
        self._checkpoint_at = time.monotonic()
        self.start_step = self._sample_step
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

    def resize(
        self, slots: list[int], remote: list[RemotePart] | None = None
    ) -> tuple[SwitchReport, TelemetrySample | None]:
        """Hot-switch the running job onto `slots` here and `remote` on other nodes (kept slots
        keep their worker process, wherever they are).

        Also returns the telemetry sample of the time the resize took: the job trained in its old
        layout while the new workers started, so that sample carries the old GPU count.
        """
        assert self.runner is not None
        remote = list(remote or [])
        old_gpus, old_layout = self.gpus, str(self.runner.layout)
        gpu_slots, per_node = self._gpu_slots(self.runner, slots, remote)
        # Back inside one node: TP may use the whole node again.
        report = self.runner.resize(gpu_slots, gpus_per_node=per_node or len(gpu_slots))
        held = self.runner.slots()
        self.slot_indices = [s.index for s in held if s.node == self.node]
        by_node = {p.node: p for p in remote}
        self.remote = [
            p.model_copy(update={"slot_indices": [s.index for s in held if s.node == p.node]})
            for p in by_node.values()
            if any(s.node == p.node for s in held)
        ]
        self._record_ranks()
        # The driver waited while the switch ran: that time was not training.
        self._busy_acc_s -= report.switch_s
        return report, self.cut_sample(gpus=old_gpus, layout=old_layout)

    def recover_here(self) -> RecoveryReport | None:
        """Go on on this node's slots alone after the job's workers on other nodes were lost,
        from the survivors' replicas (no step lost); None where they do not hold the whole
        state (the scheduler then places the job again, from its newest checkpoint)."""
        assert self.runner is not None
        with contextlib.suppress(WorkerFailed):
            self._halt()
        try:
            report = self.runner.recover([GpuSlot(self.node, i) for i in self.slot_indices])
        except (WorkerFailed, ValueError) as exc:
            log.warning(
                "job %d: no recovery from replicas on node %s: %s", self.job_id, self.node, exc
            )
            return None
        if report.recovered_from != "replicas":
            return None  # recover() restarts from a checkpoint only when given one
        self.remote = []
        self.lost_nodes = list(report.lost_nodes)
        self._last_step = report.step
        self._sample_step = report.step
        self._record_ranks()
        self._run()
        return report

    def _record_ranks(self) -> None:
        if self.log_dir is not None and self.runner is not None:
            try:
                record_ranks(self.log_dir, self.runner.worker_ids())
            except OSError as exc:  # logs are a convenience; training goes on without them
                log.warning("job %d: cannot record its ranks' logs: %s", self.job_id, exc)

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
        self.remote = []
        self.state = "paused"

    def stop(self, final_state: JobState = "stopped", export_dir: Path | None = None) -> None:
        """Stop training for good and release every worker; a module job that finished is first
        exported to `export_dir` (safetensors + config.json, see runtime/export.py)."""
        if self.runner is not None:
            with contextlib.suppress(WorkerFailed, RuntimeError):
                self._last_step = self.runner.step_progress().step
            # A failed driver must not keep the workers alive: stop() releases them regardless.
            with contextlib.suppress(WorkerFailed):
                self._halt()
            if export_dir is not None and self.runner.model_info is not None:
                try:
                    self.runner.export(export_dir)
                    self.exported_to = export_dir
                    log.info("job %d: exported to %s", self.job_id, export_dir)
                except (OSError, RuntimeError, WorkerFailed) as exc:
                    # The job did train; a full disk must not turn it into a failure.
                    log.warning("job %d: export to %s failed: %s", self.job_id, export_dir, exc)
            self.runner.stop()
            self.runner = None
        self.paused = None
        self.slot_indices = []
        self.remote = []
        self.state = final_state
        if self.checkpoints is not None and final_state == "finished":
            # Only a finished job's checkpoints are surely unneeded: a stopped one may be
            # resuming on another node from them right now.
            self.checkpoints.remove(self.job_id)

    def fail(self, message: str, job_code: bool = False) -> None:
        """Record a worker failure (`job_code`: of the job's own code, so it cannot run anywhere)
        and release whatever is left of the job's workers."""
        self.error = short_error(message)
        self.job_error = job_code
        if self.runner is not None:
            with contextlib.suppress(WorkerFailed):
                self._halt()
            try:
                self.runner.stop()
            except Exception as exc:  # the workers are already broken; freeing them is best effort
                log.warning("job %d: stopping failed workers: %s", self.job_id, exc)
            self.runner = None
        self.slot_indices = []
        self.remote = []
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
            gpus = self.gpus
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
