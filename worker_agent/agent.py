"""The worker agent: registers with the scheduler, heartbeats, reports telemetry, and serves the
allocation API (start / hot-switch / pause / resume / stop jobs on this node's GPU slots).

One process per node. The HTTP API runs on uvicorn; jobs train in their runners' background
threads and worker processes; heartbeats, telemetry and finish detection are small named threads.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from worker_agent.checkpoints import CheckpointStore
from worker_agent.managed import ManagedJob, PowerReader
from worker_agent.protocol import (
    AGENT_SECRET_HEADER,
    AgentStatus,
    AllocationAck,
    AllocationCommand,
    GpuSlotInfo,
    Heartbeat,
    HeartbeatAck,
    NodeRegistered,
    NodeRegistration,
    PowerSource,
    RunningJob,
    StopCommand,
    TelemetryAck,
    TelemetryReport,
)
from worker_agent.runtime.errors import JobSpecError, LayoutError, SwitchFailed, WorkerFailed
from worker_agent.telemetry import NvmlMeter, Outbox, energy_kwh
from worker_agent.workloads import WorkloadError, job_spec_for

log = logging.getLogger("greenflow.agent")

MAX_BATCH = 1000  # TelemetryReport.samples max_length
MAX_ENDED = 1000  # tombstones of stopped jobs kept for idempotent repeats


# ----- errors ---------------------------------------------------------------------------------
class AgentError(Exception):
    """An error the allocation API answers with `status_code` and this message."""

    status_code = 409


class StaleGeneration(AgentError):
    """A command older than the generation the job already applied."""


class SlotConflict(AgentError):
    """A slot the command names is held by another job."""


class JobGone(AgentError):
    """The job already finished, failed, or was stopped on this agent."""


class BadAllocation(AgentError):
    """The command cannot be applied as given (bad slots, no layout, bad workload)."""

    status_code = 422


class SwitchRejected(AgentError):
    """The hot switch failed and the job was rolled back to its old slots."""


class JobFailedError(AgentError):
    """The job's workers failed while applying the command."""

    status_code = 503


class _Retryable(Exception):
    """A scheduler answer worth retrying (5xx, 429)."""


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


# ----- the agent ------------------------------------------------------------------------------
class Agent:
    """Jobs on this node's slots, and the loops that talk to the scheduler."""

    def __init__(self, config: AgentConfig, nvml: NvmlMeter | None = None) -> None:
        self.config = config
        self.agent_url = config.advertise_url or ""
        self.nvml = nvml
        self.outbox = Outbox(config.outbox_max_samples)
        self.registered: NodeRegistered | None = None
        self._registered_event = threading.Event()
        self._shutdown = threading.Event()
        self._flush_now = threading.Event()
        self._lock = threading.Lock()
        self._jobs: dict[int, ManagedJob] = {}
        self._slot_owner: dict[int, int] = {}
        # Stopped jobs the scheduler has seen stopped: kept so repeated commands stay harmless.
        self._ended: dict[int, RunningJob] = {}
        self._stop_commanded: set[int] = set()
        self._threads: list[threading.Thread] = []
        self.fatal_error: str | None = None
        """Why the agent gave up on its own (the CLI exits 2 with it)."""
        self.on_fatal: Callable[[], None] | None = None
        self._nvml_energy_j: dict[int, tuple[tuple[int, ...], float]] = {}
        self._checkpoints = (
            None if config.checkpoint_dir is None else CheckpointStore(config.checkpoint_dir)
        )

    # ----- lifecycle ------------------------------------------------------------------------
    def start_background(self) -> None:
        """Start registration, heartbeat, telemetry and monitor threads."""
        for name, target in (
            ("greenflow-agent-heartbeat", self._heartbeat_loop),
            ("greenflow-agent-telemetry", self._telemetry_loop),
            ("greenflow-agent-monitor", self._monitor_loop),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self) -> None:
        """Stop every job's workers, send what telemetry is pending (briefly), stop the loops."""
        self._shutdown.set()
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            with job.lock:
                sample = job.cut_sample()
                if sample is not None:
                    self.outbox.put(sample)
                job.stop()
            self._release_slots(job.job_id, keep=[])
        self._flush_now.set()
        for t in self._threads:
            t.join(timeout=15)
        if len(self.outbox) and self.registered is not None:
            with self._client() as client:
                self._flush(client, give_up_after_s=2.0)

    # ----- allocation API -------------------------------------------------------------------
    def apply_allocation(self, cmd: AllocationCommand) -> AllocationAck:
        """Apply an allocation command (start, hot-switch, pause, resume) idempotently."""
        job = self._job_for(cmd)
        with job.lock:
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
                job.estimated_power_w = dict(cmd.estimated_power_w)
                self._reserve(job, slots)
                ack = self._apply(job, cmd, slots)
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
            if job.state not in ("stopped", "finished", "failed"):
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

    def status(self) -> AgentStatus:
        """Every job this agent runs or still reports."""
        return AgentStatus(name=self.config.name, jobs=self.running_jobs())

    def running_jobs(self) -> list[RunningJob]:
        """RunningJob of every job (running, paused, or ended but not yet forgotten)."""
        with self._lock:
            jobs = sorted(self._jobs.values(), key=lambda j: j.job_id)
        return [j.running_job() for j in jobs]

    def free_slots(self) -> list[int]:
        """Slot indices no job holds."""
        with self._lock:
            return [s.index for s in self.config.slots if s.index not in self._slot_owner]

    # ----- allocation internals -------------------------------------------------------------
    def _job_for(self, cmd: AllocationCommand) -> ManagedJob:
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
                job_spec = job_spec_for(cmd.spec, len(self.config.slots))
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
        return slots

    def _reserve(self, job: ManagedJob, slots: list[int]) -> None:
        with self._lock:
            taken = {
                s: self._slot_owner[s]
                for s in slots
                if self._slot_owner.get(s, job.job_id) != job.job_id
            }
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
                job.start(slots)
                return job.ack(cmd.generation)
            if set(slots) == set(job.slot_indices):
                return job.ack(cmd.generation)
            self._cut(job)
            report, sample = job.resize(slots)
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
                return joules / interval_s, joules / 3.6e6, "nvml"
            power_w = nvml.power_w(job.slot_indices)
            return power_w, energy_kwh(power_w, interval_s), "nvml"

        return read

    # ----- scheduler calls ------------------------------------------------------------------
    def _client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.config.scheduler_url.rstrip("/"),
            headers={"Authorization": f"Bearer {self.config.token}"},
            timeout=self.config.request_timeout_s,
        )

    def _post(
        self, client: httpx.Client, path: str, body: BaseModel, give_up_after_s: float | None
    ) -> httpx.Response:
        """POST with exponential backoff on network errors, 5xx and 429; other answers return."""

        def attempt() -> httpx.Response:
            resp = client.post(
                path, content=body.model_dump_json(), headers={"content-type": "application/json"}
            )
            if resp.status_code >= 500 or resp.status_code == 429:
                raise _Retryable(f"{path}: HTTP {resp.status_code} {resp.text[:200]}")
            return resp

        def give_up(state: RetryCallState) -> bool:
            if self._shutdown.is_set():
                return True
            return give_up_after_s is not None and stop_after_delay(give_up_after_s)(state)

        def note(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("scheduler %s unreachable (%s); retrying", path, exc)

        def sleep(seconds: float) -> None:
            self._shutdown.wait(seconds)  # wakes early when the agent shuts down

        retrying = Retrying(
            retry=retry_if_exception_type((httpx.TransportError, _Retryable)),
            wait=wait_exponential(multiplier=0.2, max=self.config.backoff_cap_s),
            stop=give_up,
            sleep=sleep,
            before_sleep=note,
            reraise=True,
        )
        return retrying(attempt)

    def register(self, client: httpx.Client) -> NodeRegistered | None:
        """Register (retrying until it works or the agent shuts down)."""
        body = NodeRegistration(
            name=self.config.name,
            agent_url=self.agent_url,
            agent_secret=self.config.secret,
            gpu_kind=self.config.gpu_kind,
            simulated=self.config.simulated,
            slots=self.config.slots,
        )
        while not self._shutdown.is_set():
            try:
                resp = self._post(client, "/v1/nodes/register", body, give_up_after_s=None)
            except (httpx.TransportError, _Retryable) as exc:
                if self._shutdown.is_set():
                    return None
                log.warning("registration failed: %s", exc)
                continue
            if resp.status_code in (200, 201):
                registered = NodeRegistered.model_validate_json(resp.content)
                self.registered = registered
                self._registered_event.set()
                log.info(
                    "registered as node %d (%s at %s)",
                    registered.node_id,
                    self.config.name,
                    self.agent_url,
                )
                return registered
            refusal = f"scheduler refused registration: HTTP {resp.status_code} {resp.text[:300]}"
            if self.registered is None and 400 <= resp.status_code < 500:
                # A bad token or an incompatible request on the first try will not fix itself.
                self.fatal_error = refusal
                log.error("%s; stopping", refusal)
                self._shutdown.set()
                if self.on_fatal is not None:
                    self.on_fatal()
                return None
            log.error("%s; retrying", refusal)
            self._shutdown.wait(self.config.backoff_cap_s)
        return None

    def _heartbeat_loop(self) -> None:
        with self._client() as client:
            if self.register(client) is None:
                return
            while not self._shutdown.is_set():
                assert self.registered is not None
                if self._shutdown.wait(self.registered.heartbeat_interval_s):
                    return
                try:
                    self._heartbeat(client)
                except Exception as exc:  # the loop must survive anything the scheduler does
                    log.warning("heartbeat failed: %s", exc)

    def _heartbeat(self, client: httpx.Client) -> None:
        body = Heartbeat(jobs=self.running_jobs())
        reported_stopped = {j.job_id for j in body.jobs if j.gpus == 0} & self._stopped_ids()
        assert self.registered is not None
        path = f"/v1/nodes/{self.config.name}/heartbeat"
        resp = self._post(client, path, body, give_up_after_s=self.registered.heartbeat_interval_s)
        if resp.status_code == 404:
            log.warning("scheduler does not know this node: registering again")
            self.register(client)
            return
        if resp.status_code != 200:
            log.error("heartbeat refused: HTTP %d %s", resp.status_code, resp.text[:300])
            return
        ack = HeartbeatAck.model_validate_json(resp.content)
        self._forget(reported_stopped)
        for job_id in ack.stop_job_ids:
            self._stop_unwanted(job_id)

    def _stopped_ids(self) -> set[int]:
        """Jobs to forget once a heartbeat has reported them: stopped here, or told to stop."""
        with self._lock:
            return {
                j.job_id
                for j in self._jobs.values()
                if j.state == "stopped" or j.job_id in self._stop_commanded
            }

    def _forget(self, job_ids: set[int]) -> None:
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

    def _stop_unwanted(self, job_id: int) -> None:
        """The scheduler no longer wants this job here: stop it and forget it."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            return
        with job.lock:
            if job.state in ("running", "paused", "idle"):
                self._cut(job)
                job.stop()
                log.info("job %d stopped: the scheduler no longer wants it here", job_id)
            self._release_slots(job_id, keep=[])
            final = job.running_job()
            with self._lock:
                self._jobs.pop(job_id, None)
                self._ended[job_id] = final

    def _telemetry_loop(self) -> None:
        while not self._registered_event.wait(0.5):
            if self._shutdown.is_set():
                return
        with self._client() as client:
            while True:
                assert self.registered is not None
                self._flush_now.wait(self.registered.telemetry_interval_s)
                self._flush_now.clear()
                if self._shutdown.is_set():
                    return
                with self._lock:
                    jobs = list(self._jobs.values())
                for job in jobs:
                    # A job busy with a command cuts its own sample; don't wait for it.
                    if job.lock.acquire(timeout=0.05):
                        try:
                            self._cut(job)
                        finally:
                            job.lock.release()
                try:
                    self._flush(client, give_up_after_s=self.registered.telemetry_interval_s)
                except Exception as exc:
                    log.warning("telemetry not sent (%d queued): %s", len(self.outbox), exc)

    def _flush(self, client: httpx.Client, give_up_after_s: float) -> None:
        """Send queued samples in batches; keep them queued if the scheduler is unreachable."""
        while len(self.outbox):
            batch = self.outbox.peek(MAX_BATCH)
            resp = self._post(
                client,
                "/v1/telemetry",
                TelemetryReport(samples=batch, node=self.config.name),
                give_up_after_s,
            )
            if resp.status_code == 200:
                TelemetryAck.model_validate_json(resp.content)
                self.outbox.ack(batch)
            elif resp.status_code == 422:
                # Invalid samples would block the queue forever: log them and drop them.
                log.error("scheduler rejected %d samples: %s", len(batch), resp.text[:500])
                self.outbox.ack(batch)
            else:
                log.warning("telemetry refused: HTTP %d %s", resp.status_code, resp.text[:300])
                return

    def _monitor_loop(self) -> None:
        """Notice jobs that trained all their samples (or whose workers died) and end them."""
        while not self._shutdown.wait(self.config.monitor_interval_s):
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
            job.fail(str(exc))
            self._release_slots(job.job_id, keep=[])
            self._flush_now.set()
            return
        if job.reached_end():
            self._cut(job, finished=True)
            job.stop("finished")
            self._release_slots(job.job_id, keep=[])
            log.info("job %d finished at step %d", job.job_id, job.step)
            self._flush_now.set()


# ----- HTTP API -------------------------------------------------------------------------------
def create_app(agent: Agent) -> FastAPI:
    """The agent's FastAPI app (every route but /healthz needs the agent secret)."""

    app = FastAPI(title="GreenFlow agent")

    def require_secret(
        secret: Annotated[str | None, Header(alias=AGENT_SECRET_HEADER)] = None,
    ) -> None:
        if secret is None or not secrets.compare_digest(
            secret.encode(), agent.config.secret.encode()
        ):
            raise HTTPException(401, f"missing or wrong {AGENT_SECRET_HEADER} header")

    Authorized = Depends(require_secret)

    @app.exception_handler(AgentError)
    async def agent_error(request: Request, exc: AgentError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status_code)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Liveness (no secret needed)."""
        return {"status": "ok", "name": agent.config.name}

    @app.get("/status", dependencies=[Authorized])
    def status() -> AgentStatus:
        """Every job this agent runs."""
        return agent.status()

    @app.post("/jobs/{job_id}/allocation", dependencies=[Authorized])
    def allocation(job_id: int, cmd: AllocationCommand) -> AllocationAck:
        """Apply an allocation: start, hot-switch, pause (0 slots) or resume a job."""
        if cmd.job_id != job_id:
            raise HTTPException(422, f"body job_id {cmd.job_id} differs from path job_id {job_id}")
        return agent.apply_allocation(cmd)

    @app.post("/jobs/{job_id}/stop", dependencies=[Authorized])
    def stop(job_id: int, cmd: StopCommand) -> RunningJob:
        """Stop a job for good and free its slots."""
        if cmd.job_id != job_id:
            raise HTTPException(422, f"body job_id {cmd.job_id} differs from path job_id {job_id}")
        return agent.stop_job(cmd)

    return app


# ----- serving --------------------------------------------------------------------------------
class _AgentServer(uvicorn.Server):
    """uvicorn server that exits cleanly on SIGINT/SIGTERM instead of re-raising the signal."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


@contextlib.contextmanager
def bound_socket(host: str, port: int) -> Iterator[socket.socket]:
    """A listening TCP socket (port 0 = a free port chosen by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
        sock.set_inheritable(True)
        yield sock
    finally:
        sock.close()


def reachable_url(host: str, port: int) -> str:
    """The URL others reach this agent at when it listens on host:port."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def serve(
    config: AgentConfig,
    nvml: NvmlMeter | None = None,
) -> str | None:
    """Run the agent until SIGINT/SIGTERM, then stop every job's workers.

    Returns None, or why the agent stopped on its own (the scheduler refused its registration).
    """
    with bound_socket(config.host, config.port) as sock:
        port = int(sock.getsockname()[1])
        agent = Agent(config, nvml)
        agent.agent_url = config.advertise_url or reachable_url(config.host, port)
        app = create_app(agent)
        server = _AgentServer(
            uvicorn.Config(
                app,
                log_level="warning",
                timeout_graceful_shutdown=30,
                lifespan="on",
            )
        )
        log.info("agent %s listening on %s", config.name, agent.agent_url)
        agent.on_fatal = lambda: setattr(server, "should_exit", True)
        agent.start_background()
        try:
            server.run(sockets=[sock])
        finally:
            log.info("shutting down: stopping every job's workers")
            agent.shutdown()
            log.info("agent %s stopped", config.name)
        return agent.fatal_error
