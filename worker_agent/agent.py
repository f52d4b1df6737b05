"""The worker agent's job book: the jobs on this node's GPU slots, who holds which slot, and the
allocation commands (start / hot-switch / pause / resume / stop) applied to them.

One process per node. The HTTP API (`api.py`) runs on uvicorn; the scheduler link
(`scheduler_link.py`) registers, heartbeats and sends telemetry; jobs train in their runners'
background threads and worker processes; finish detection is a small named thread.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import ValidationError

from worker_agent.bundle import (
    DEFAULT_CACHE_MAX_BYTES,
    BundleError,
    mark_used,
    prune_cache,
    unpack_bundle,
)
from worker_agent.checkpoints import CheckpointStore
from worker_agent.errors import (
    BadAllocation,
    BundleUnavailable,
    JobCodeError,
    JobFailedError,
    JobGone,
    SlotConflict,
    StaleGeneration,
    SwitchRejected,
)
from worker_agent.logstore import (
    DEFAULT_MAX_BYTES,
    Stream,
    job_dir,
    read_chunk,
    scalar_curve,
    trim,
)
from worker_agent.managed import ClusterAccess, ManagedJob, PowerReader
from worker_agent.protocol import (
    AgentStatus,
    AllocationAck,
    AllocationCommand,
    GpuSlotInfo,
    JobLogChunk,
    JobScalarCurve,
    PowerSource,
    RemotePart,
    RunningJob,
    StopCommand,
)
from worker_agent.runtime.errors import (
    JobCodeFailed,
    JobSpecError,
    LayoutError,
    SwitchFailed,
    WorkerFailed,
)
from worker_agent.runtime.remote import WorkerHost
from worker_agent.scheduler_link import SchedulerLink
from worker_agent.telemetry import J_PER_KWH, NvmlMeter, Outbox, energy_kwh
from worker_agent.workloads import WorkloadError, job_spec_for

log = logging.getLogger("greenflow.agent")

MAX_ENDED = 1000  # tombstones of stopped jobs kept for idempotent repeats
LOG_TRIM_INTERVAL_S = 5.0
REMOTE_RELEASE_WAIT_S = 10.0
"""How long a command waits for another node's job's released workers to leave its slots."""


# ----- configuration --------------------------------------------------------------------------
@dataclass
class AgentConfig:
    """How one agent runs."""

    scheduler_url: str
    token: str
    name: str
    slots: list[GpuSlotInfo]
    simulated: bool = True
    gpu_kind: str = "simulated"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_url: str | None = None
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    backoff_cap_s: float = 5.0
    request_timeout_s: float = 10.0
    monitor_interval_s: float = 0.2
    outbox_max_samples: int = 10_000
    checkpoint_dir: Path | None = None
    """Shared storage for job checkpoints (None: a lost node's jobs restart from step 0)."""
    checkpoint_interval_s: float = 300.0
    data_dir: Path | None = None
    """The agent's own files: workdir bundle cache (`bundles/<sha256>`), jobs' output (`logs/`);
    None: a new temporary directory, removed at shutdown."""
    export_dir: Path | None = None
    """Where a finished module job's result is exported (None: `<data_dir>/exports`; the CLI
    defaults to the user's data directory)."""
    bundle_cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES
    """Cap on the unpacked workdir bundles in `<data_dir>/bundles`; the least recently used go
    first, never one a job on this agent uses."""
    log_max_bytes: int = DEFAULT_MAX_BYTES
    """Cap on each worker's captured output (and on its scalars), kept in `<data_dir>/logs`."""
    dcgm_url: str | None = None
    """A DCGM exporter's Prometheus endpoint to read GPU power from when NVML is not used."""
    rapl_root: Path | None = Path("/sys/class/powercap")
    """Where RAPL's CPU package energy counters are (None: estimate the host from the model)."""
    rendezvous_host: str | None = None
    """The address other nodes reach this node on: its worker host listens there, and jobs
    whose runner is here host their rendezvous store there. None: jobs stay inside this node."""
    worker_host_port: int = 0
    """The worker host's port (0: a free one, sent at registration)."""


# ----- the agent ------------------------------------------------------------------------------
class Agent:
    """Jobs on this node's slots; the scheduler link and the monitor loop run beside them."""

    def __init__(self, config: AgentConfig, nvml: NvmlMeter | None = None) -> None:
        self.config = config
        self.nvml = nvml
        self.outbox = Outbox(config.outbox_max_samples)
        self._shutdown = threading.Event()
        self.link = SchedulerLink(config, self, self.outbox, self._shutdown, nvml=nvml)
        self._lock = threading.Lock()
        self._jobs: dict[int, ManagedJob] = {}
        self._slot_owner: dict[int, int] = {}
        # Stopped jobs the scheduler has seen stopped: kept so repeated commands stay harmless.
        self._ended: dict[int, RunningJob] = {}
        self._stop_commanded: set[int] = set()
        self._threads: list[threading.Thread] = []
        self._nvml_energy_j: dict[int, tuple[tuple[int, ...], float]] = {}
        self._checkpoints = (
            None if config.checkpoint_dir is None else CheckpointStore(config.checkpoint_dir)
        )
        self.data_dir = config.data_dir or Path(
            tempfile.mkdtemp(prefix=f"greenflow-agent-{config.name}-")
        )
        self.export_dir = config.export_dir or self.data_dir / "exports"
        self.logs_dir = self.data_dir / "logs"
        self._trimmed_at = 0.0
        self._bundle_lock = threading.Lock()
        self.worker_host: WorkerHost | None = None
        """Starts this node's workers of jobs whose runner is on another node."""
        self._cluster: ClusterAccess | None = None
        if config.rendezvous_host is not None:
            # A random secret (no grant matches it) until the first registration's answer.
            self.worker_host = WorkerHost(
                config.rendezvous_host, secrets.token_hex(32).encode(), config.worker_host_port
            )
            config.worker_host_port = self.worker_host.port
            self.worker_host.admit = self._admit_remote
            self._cluster = ClusterAccess(config.rendezvous_host)
        self.link.on_registered = self._registered
        self.link.remote_holders = self.remote_holders

    def remote_holders(self) -> dict[int, int]:
        """Slot -> job of this node's slots running workers of jobs whose runner is elsewhere."""
        if self.worker_host is None:
            return {}
        return {
            slot: int(job)
            for slot, job in self.worker_host.holdings().items()
            if job is not None and job.isdigit()
        }

    def _admit_remote(self, slot: int | None, job: str | None) -> None:
        """A runner on another node asks this node's worker host for a worker on `slot`:
        refused unless the slot exists and no other job holds it here."""
        known = {s.index for s in self.config.slots}
        if slot is None or slot not in known:
            raise ValueError(f"slot {slot} does not exist on node {self.config.name}")
        others = {s: str(j) for s, j in self.remote_holders().items()}
        with self._lock:
            others |= {s: str(j) for s, j in self._slot_owner.items()}
        holder = others.get(slot)
        if holder is not None and holder != job:
            raise ValueError(f"slot {slot} of node {self.config.name} is held by job {holder}")

    def _registered(self, agent_secret: str) -> None:
        """A registration drew a new node secret: grants derive from it from now on."""
        if self.worker_host is not None:
            self.worker_host.secret = agent_secret.encode()

    # ----- lifecycle ------------------------------------------------------------------------
    def start_background(self) -> None:
        """Start registration, heartbeat, telemetry and monitor threads."""
        for name, target in (
            ("greenflow-agent-heartbeat", self.link.heartbeat_loop),
            ("greenflow-agent-telemetry", self.link.telemetry_loop),
            ("greenflow-agent-monitor", self._monitor_loop),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if self.worker_host is not None:
            # Not joined at shutdown: close() ends its accept loop.
            threading.Thread(
                target=self.worker_host.serve_forever, name="greenflow-worker-host", daemon=True
            ).start()

    def shutdown(self) -> None:
        """Stop every job's workers, send what telemetry is pending (briefly), stop the loops."""
        self._shutdown.set()
        # The node's last power interval, while its jobs still hold their GPUs.
        self.link.cut_node_power()
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            with job.lock:
                sample = job.cut_sample()
                if sample is not None:
                    self.outbox.put(sample)
                job.stop()
            self._release_slots(job.job_id, keep=[])
        if self.worker_host is not None:
            self.worker_host.close()
        self.link.flush_now.set()
        for t in self._threads:
            t.join(timeout=15)
        pending = len(self.outbox) + len(self.link.node_power_outbox)
        if pending and self.link.registered is not None:
            with self.link.client() as client:
                self.link.flush(client, give_up_after_s=2.0)
        if self.config.data_dir is None and self.config.export_dir is not None:
            # A directory of our own making (the exports are elsewhere): nothing in it is kept.
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # ----- allocation API -------------------------------------------------------------------
    def apply_allocation(self, cmd: AllocationCommand) -> AllocationAck:
        """Apply an allocation command (start, hot-switch, pause, resume) idempotently."""
        workdir, bundle_problem = self._workdir_for(cmd)
        job = self._job_for(cmd, workdir)
        with job.lock:
            if job.state in ("stopped", "failed") and cmd.generation > job.generation:
                # It ended (its workers died) between the lookup and the lock: a newer
                # generation places it here afresh, as `_job_for` does for an ended job.
                return self.apply_allocation(cmd)
            if cmd.generation < job.generation:
                raise StaleGeneration(
                    f"job {cmd.job_id}: command generation {cmd.generation} is older than "
                    f"the applied generation {job.generation}"
                )
            if cmd.generation == job.generation and job.last_ack is not None:
                return job.last_ack
            try:
                if job.state in ("finished", "stopped", "failed"):
                    raise JobGone(
                        f"job {cmd.job_id} is {job.state} on this agent (generation "
                        f"{job.generation}); it cannot be allocated again"
                    )
                if cmd.spec != job.spec:
                    raise BadAllocation(
                        f"job {cmd.job_id}: spec differs from the one it started with "
                        f"({job.spec.model_dump()}); a job's workload cannot change"
                    )
                slots = self._check_slots(cmd)
                if bundle_problem is not None and job.state == "idle":
                    job.fail(bundle_problem, job_code=True)
                    raise JobCodeError(f"job {cmd.job_id}: {job.error}")
                job.estimated_power_w = dict(cmd.estimated_power_w)
                self._reserve(job, slots)
                ack = self._apply(job, cmd, slots)
                # The scheduler placed it knowing where it runs: a past loss is told.
                job.lost_nodes = []
            except BaseException:
                with self._lock:
                    # A job whose very first command failed was never here.
                    if job.state == "idle" and job.last_ack is None:
                        self._jobs.pop(job.job_id, None)
                raise
            finally:
                self._release_slots(job.job_id, keep=job.slot_indices)
            job.generation = cmd.generation
            job.last_ack = ack
            log.info(
                "job %d generation %d: %d slot(s) %s, layout %s, step %d%s",
                job.job_id,
                cmd.generation,
                ack.gpus,
                job.slot_indices,
                ack.layout,
                ack.step,
                f", hot switch {ack.switch_s:.2f} s" if ack.hot_switch and ack.switch_s else "",
            )
            return ack

    def stop_job(self, cmd: StopCommand) -> RunningJob:
        """Stop a job for good and free its slots (repeats are harmless)."""
        with self._lock:
            job = self._jobs.get(cmd.job_id)
            ended = self._ended.get(cmd.job_id)
        if job is None and ended is not None:
            return ended
        if job is None:
            # Not running here is exactly what a stop asks for (e.g. after this agent restarted).
            log.info("job %d: stop for a job this agent does not run; nothing to do", cmd.job_id)
            gone = RunningJob(
                job_id=cmd.job_id,
                generation=cmd.generation,
                gpus=0,
                slot_indices=[],
                layout=None,
                step=0,
                samples_done=0,
                worker_pids=[],
            )
            with self._lock:
                self._ended[cmd.job_id] = gone
            return gone
        with job.lock:
            if cmd.generation < job.generation:
                raise StaleGeneration(
                    f"job {cmd.job_id}: stop generation {cmd.generation} is older than "
                    f"the applied generation {job.generation}"
                )
            if job.reached_end():
                # The scheduler counted the last samples before this agent's monitor looked:
                # end it as the monitor would, so the trained model is still exported.
                self._finish(job)
            elif job.state not in ("stopped", "finished", "failed"):
                sample = job.cut_sample()
                if sample is not None:
                    self.outbox.put(sample)
                job.stop()
                log.info("job %d stopped (%s)", job.job_id, cmd.reason or "no reason given")
            job.generation = cmd.generation
            self._release_slots(job.job_id, keep=[])
            with self._lock:
                self._stop_commanded.add(job.job_id)
            return job.running_job()

    def job_logs(
        self,
        job_id: int,
        rank: int,
        stream: Stream,
        offset: int,
        limit: int,
        tail: int | None = None,
    ) -> JobLogChunk:
        """A piece of a job worker's captured output (also after the job ended here)."""
        return read_chunk(self.logs_dir, job_id, rank, stream, offset, limit, tail)

    def job_curve(self, job_id: int, max_points: int) -> JobScalarCurve:
        """The job's logged scalars per step, across its workers (also after it ended here)."""
        return scalar_curve(self.logs_dir, job_id, max_points)

    def status(self) -> AgentStatus:
        """Every job this agent runs or still reports."""
        return AgentStatus(name=self.config.name, jobs=self.running_jobs())

    def running_jobs(self) -> list[RunningJob]:
        """RunningJob of every job (running, paused, or ended but not yet forgotten)."""
        with self._lock:
            jobs = sorted(self._jobs.values(), key=lambda j: j.job_id)
        return [j.running_job() for j in jobs]

    # ----- allocation internals -------------------------------------------------------------
    def _workdir_for(self, cmd: AllocationCommand) -> tuple[str | None, str | None]:
        """(the job's unpacked workdir bundle, None) or (None, why the bundle is unusable);
        fetched from the scheduler once per bundle, then taken from the cache."""
        sha = cmd.spec.bundle_sha256
        if sha is None:
            return None, None
        cache = self.data_dir / "bundles"
        # One fetch (or eviction) at a time: two jobs of one bundle must not both download it.
        with self._bundle_lock:
            if (cache / sha).is_dir():
                mark_used(cache / sha)
                return str(cache / sha), None
            try:
                data = self.link.get_bundle(sha)
            except (httpx.HTTPError, RuntimeError) as exc:
                raise BundleUnavailable(
                    f"job {cmd.job_id}: cannot fetch bundle {sha[:12]} now: {exc}"
                ) from exc
            if data is None:
                return None, f"workdir bundle {sha[:12]} is not on the scheduler"
            try:
                path = unpack_bundle(data, sha, cache)
            except BundleError as exc:
                return None, f"workdir bundle unusable: {exc}"
            log.info("job %d: bundle %s unpacked to %s", cmd.job_id, sha[:12], path)
            with self._lock:
                held = {
                    j.spec.bundle_sha256
                    for j in self._jobs.values()
                    if j.state not in ("stopped", "finished", "failed")
                    and j.spec.bundle_sha256 is not None
                }
            evicted = prune_cache(cache, self.config.bundle_cache_max_bytes, {sha, *held})
            if evicted:
                log.info(
                    "bundle cache over its cap: removed %s", ", ".join(e[:12] for e in evicted)
                )
            return str(path), None

    def _job_for(self, cmd: AllocationCommand, workdir: str | None = None) -> ManagedJob:
        with self._lock:
            job = self._jobs.get(cmd.job_id)
            if job is not None:
                if job.state not in ("stopped", "failed") or cmd.generation <= job.generation:
                    return job
                # The scheduler placed a stopped (or failed) job here again with a newer
                # generation: it starts afresh; its old workers are already gone.
                log.info("job %d: generation %d restarts it here", cmd.job_id, cmd.generation)
                self._jobs.pop(cmd.job_id)
            ended = self._ended.get(cmd.job_id)
            if ended is not None:
                if ended.finished or cmd.generation <= ended.generation:
                    raise JobGone(
                        f"job {cmd.job_id} ended on this agent at generation {ended.generation}; "
                        f"generation {cmd.generation} cannot run it again"
                    )
                log.info("job %d: generation %d restarts it here", cmd.job_id, cmd.generation)
                del self._ended[cmd.job_id]
            try:
                job_spec = job_spec_for(cmd.spec, len(self.config.slots), workdir)
            except (WorkloadError, ValidationError, ValueError) as exc:
                raise BadAllocation(f"job {cmd.job_id}: {exc}") from exc
            job = ManagedJob(
                cmd.job_id,
                cmd.spec,
                job_spec,
                node=self.config.name,
                backend="gloo" if self.config.simulated else None,
                power_reader=None if self.nvml is None else self._nvml_reader(),
                checkpoints=self._checkpoints,
                checkpoint_interval_s=self.config.checkpoint_interval_s,
                log_dir=job_dir(self.logs_dir, cmd.job_id),
                cluster=self._cluster,
                export_root=self.export_dir,
            )
            self._jobs[cmd.job_id] = job
            return job

    def _check_slots(self, cmd: AllocationCommand) -> list[int]:
        known = {s.index for s in self.config.slots}
        slots = list(cmd.slot_indices)
        if len(set(slots)) != len(slots):
            raise BadAllocation(f"slot_indices has duplicates: {slots}")
        unknown = sorted(set(slots) - known)
        if unknown:
            raise BadAllocation(
                f"slot_indices {unknown} do not exist on node {self.config.name} "
                f"(slots: {sorted(known)})"
            )
        if cmd.remote:
            if self._cluster is None:
                raise BadAllocation(
                    f"job {cmd.job_id}: remote slots on {[p.node for p in cmd.remote]}, but this "
                    "agent runs jobs inside its node only (no --rendezvous-host)"
                )
            nodes = [p.node for p in cmd.remote]
            if not slots or self.config.name in nodes or len(set(nodes)) != len(nodes):
                raise BadAllocation(
                    f"job {cmd.job_id}: a job across nodes needs slots on this node and each "
                    f"other node once (remote parts on {nodes})"
                )
        return slots

    def _reserve(self, job: ManagedJob, slots: list[int]) -> None:
        # Workers of jobs whose runner is on another node hold their slots here too. One that
        # its runner just released (the scheduler sends shrinks first) exits within seconds.
        deadline = time.monotonic() + REMOTE_RELEASE_WAIT_S
        remote = self.remote_holders()
        while any(remote.get(s, job.job_id) != job.job_id for s in slots):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
            remote = self.remote_holders()
        with self._lock:
            owners = remote | self._slot_owner
            taken = {s: owners[s] for s in slots if owners.get(s, job.job_id) != job.job_id}
            if taken:
                desc = ", ".join(f"slot {s} by job {j}" for s, j in sorted(taken.items()))
                raise SlotConflict(f"job {job.job_id}: slots are held ({desc}); free them first")
            for s in slots:
                self._slot_owner[s] = job.job_id

    def _release_slots(self, job_id: int, keep: list[int]) -> None:
        with self._lock:
            for s, owner in list(self._slot_owner.items()):
                if owner == job_id and s not in keep:
                    del self._slot_owner[s]

    def _apply(self, job: ManagedJob, cmd: AllocationCommand, slots: list[int]) -> AllocationAck:
        """Change the job's allocation; raises AgentError subclasses the API maps to 4xx/503."""
        try:
            if not slots:
                if job.state == "running":
                    self._cut(job)
                    job.pause()
                    log.info("job %d paused at step %d (state in memory)", job.job_id, job.step)
                return job.ack(cmd.generation)
            if job.state in ("idle", "paused"):
                job.start(slots, cmd.remote)
                # The step it started at: training may already be a step further on an idle
                # machine, and the scheduler's "started at step N" and rewind read this.
                return job.ack(cmd.generation, at_step=job.start_step)
            if set(slots) == set(job.slot_indices) and _remote_slots(cmd.remote) == _remote_slots(
                job.remote
            ):
                return job.ack(cmd.generation, started=False)
            self._cut(job)
            report, sample = job.resize(slots, cmd.remote)
            if sample is not None:
                self.outbox.put(sample)
            return job.ack(cmd.generation, report)
        except (LayoutError, JobSpecError) as exc:
            raise BadAllocation(f"job {job.job_id} on {len(slots)} slot(s): {exc}") from exc
        except SwitchFailed as exc:
            raise SwitchRejected(
                f"job {job.job_id}: hot switch to slots {slots} failed and was rolled back to "
                f"slots {job.slot_indices} ({exc.recovered_from}): {exc}"
            ) from exc
        except JobCodeFailed as exc:
            job.fail(str(exc), job_code=True)
            raise JobCodeError(f"job {job.job_id}: the job's code failed: {job.error}") from exc
        except WorkerFailed as exc:
            job.fail(str(exc))
            raise JobFailedError(f"job {job.job_id}: workers failed: {exc}") from exc

    def _cut(self, job: ManagedJob, finished: bool = False) -> None:
        """Close the job's telemetry interval now (before its allocation changes)."""
        sample = job.cut_sample(finished=finished)
        if sample is not None:
            self.outbox.put(sample)

    # ----- power ----------------------------------------------------------------------------
    def _nvml_reader(self) -> PowerReader:
        nvml = self.nvml

        def read(
            job: ManagedJob, interval_s: float, busy_fraction: float
        ) -> tuple[float, float, PowerSource]:
            assert nvml is not None
            devices = tuple(job.slot_indices)
            total_j = nvml.energy_j(devices)
            last = self._nvml_energy_j.get(job.job_id)
            if total_j is not None:
                self._nvml_energy_j[job.job_id] = (devices, total_j)
            # The energy counters give the exact interval energy when the devices did not change.
            if (
                total_j is not None
                and last is not None
                and last[0] == devices
                and total_j >= last[1]
            ):
                joules = total_j - last[1]
                return joules / interval_s, joules / J_PER_KWH, "nvml"
            power_w = nvml.power_w(job.slot_indices)
            return power_w, energy_kwh(power_w, interval_s), "nvml"

        return read

    # ----- scheduler calls ------------------------------------------------------------------
    def stopped_ids(self) -> set[int]:
        """Jobs to forget once a heartbeat has reported them: stopped here, or told to stop."""
        with self._lock:
            return {
                j.job_id
                for j in self._jobs.values()
                if j.state == "stopped" or j.job_id in self._stop_commanded
            }

    def forget(self, job_ids: set[int]) -> None:
        """Move stopped jobs the scheduler has now seen into the small tombstone map."""
        for job_id in job_ids:
            with self._lock:
                job = self._jobs.get(job_id)
            if job is None:
                continue
            with job.lock:
                if job.state != "stopped":
                    continue  # it was placed here again meanwhile (a newer generation restarted it)
                final = job.running_job()
            with self._lock:
                if self._jobs.get(job_id) is not job:
                    continue
                self._jobs.pop(job_id, None)
                self._stop_commanded.discard(job_id)
                self._ended[job_id] = final
                while len(self._ended) > MAX_ENDED:
                    self._ended.pop(next(iter(self._ended)))

    def stop_unwanted(self, job_id: int) -> None:
        """The scheduler no longer wants this job here: stop it and forget it."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            return
        with job.lock:
            if job.reached_end():
                self._finish(job)  # its SUCCEEDED came from its last samples: export it first
            elif job.state in ("running", "paused", "idle"):
                self._cut(job)
                job.stop()
                log.info("job %d stopped: the scheduler no longer wants it here", job_id)
            self._release_slots(job_id, keep=[])
            final = job.running_job()
            with self._lock:
                self._jobs.pop(job_id, None)
                self._ended[job_id] = final

    def cut_samples(self) -> None:
        """Close every job's telemetry interval into the outbox (the telemetry loop's tick)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            # A job busy with a command cuts its own sample; don't wait for it.
            if job.lock.acquire(timeout=0.05):
                try:
                    self._cut(job)
                finally:
                    job.lock.release()

    def _monitor_loop(self) -> None:
        """Notice jobs that trained all their samples (or whose workers died) and end them."""
        while not self._shutdown.wait(self.config.monitor_interval_s):
            now = time.monotonic()
            if now - self._trimmed_at > LOG_TRIM_INTERVAL_S:
                self._trimmed_at = now
                trim(self.logs_dir, self.config.log_max_bytes)
            with self._lock:
                jobs = [j for j in self._jobs.values() if j.state == "running"]
            for job in jobs:
                if not job.lock.acquire(blocking=False):
                    continue  # a command is running on it; look again next round
                try:
                    self._check_job(job)
                except Exception as exc:
                    log.exception("monitor: job %d: %s", job.job_id, exc)
                finally:
                    job.lock.release()

    def _check_job(self, job: ManagedJob) -> None:
        if job.state != "running" or job.runner is None:
            return
        try:
            job.runner.step_progress()
            if not job.reached_end():
                job.maybe_checkpoint(time.monotonic())
        except WorkerFailed as exc:
            log.error("job %d failed: %s", job.job_id, exc)
            self._cut(job)
            message = str(exc)
            if job.remote:
                # Say which node went, so the scheduler's event names it.
                lost = job.runner.lost_nodes() if job.runner is not None else []
                if lost and not isinstance(exc, JobCodeFailed) and self._recover(job, lost):
                    return
                if lost:
                    message = f"workers on node(s) {', '.join(lost)} lost: {message}"
            job.fail(message, job_code=isinstance(exc, JobCodeFailed))
            self._release_slots(job.job_id, keep=[])
            self.link.flush_now.set()
            return
        if job.reached_end():
            self._finish(job)

    def _recover(self, job: ManagedJob, lost: list[str]) -> bool:
        """Whether the job goes on here alone after losing its workers on `lost` nodes (from
        its survivors' replicas); the heartbeat then tells the scheduler (`lost_nodes`)."""
        if self.config.name in lost or not job.slot_indices:
            return False
        report = job.recover_here()
        if report is None:
            return False
        log.warning(
            "job %d: workers on node(s) %s lost; goes on on %d slot(s) of this node (%s) from "
            "its replicas at step %d, recovered in %.2f s",
            job.job_id,
            ", ".join(lost),
            len(job.slot_indices),
            report.dst,
            report.step,
            report.recover_s,
        )
        self.link.flush_now.set()
        return True

    def _finish(self, job: ManagedJob) -> None:
        """End a job that trained all its samples: last telemetry, export, slots freed."""
        self._cut(job, finished=True)
        job.stop("finished", export_dir=self.export_dir / f"job-{job.job_id}")
        self._release_slots(job.job_id, keep=[])
        log.info("job %d finished at step %d", job.job_id, job.step)
        self.link.flush_now.set()


def _remote_slots(parts: list[RemotePart]) -> set[tuple[str, int]]:
    return {(p.node, i) for p in parts for i in p.slot_indices}
