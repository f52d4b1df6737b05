"""The agent's link to the scheduler: registration, heartbeats and telemetry (agent -> scheduler).

Every call goes through `post`: httpx + tenacity, exponential backoff on network errors, 5xx and
429. The loops never die: when the scheduler is down they log and try again next interval, and
the outbox keeps the samples.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import httpx
from pydantic import BaseModel
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from worker_agent.node_power import GpuEnergyMeter, NodeModel, NodePowerSampler, RaplReader
from worker_agent.protocol import (
    Heartbeat,
    HeartbeatAck,
    NodeRegistered,
    NodeRegistration,
    RunningJob,
    TelemetryAck,
    TelemetryReport,
)
from worker_agent.telemetry import NodePowerOutbox, Outbox

if TYPE_CHECKING:
    from worker_agent.agent import AgentConfig

log = logging.getLogger("greenflow.agent")

MAX_BATCH = 1000  # TelemetryReport.samples max_length
MAX_NODE_POWER_BATCH = 100  # node power samples per report (each holds every GPU's reading)


class _Retryable(Exception):
    """A scheduler answer worth retrying (5xx, 429)."""


class LinkedJobs(Protocol):
    """What the link needs from the agent's job book."""

    def running_jobs(self) -> list[RunningJob]:
        """RunningJob of every job the agent reports."""
        ...

    def stopped_ids(self) -> set[int]:
        """Jobs to forget once a heartbeat has reported them."""
        ...

    def forget(self, job_ids: set[int]) -> None:
        """Move stopped jobs the scheduler has now seen into tombstones."""
        ...

    def stop_unwanted(self, job_id: int) -> None:
        """Stop and forget a job the scheduler no longer wants here."""
        ...

    def cut_samples(self) -> None:
        """Close every running job's telemetry interval into the outbox."""
        ...


class SchedulerLink:
    """Registers this node, heartbeats its jobs and sends their telemetry to the scheduler."""

    def __init__(
        self,
        config: AgentConfig,
        jobs: LinkedJobs,
        outbox: Outbox,
        shutdown: threading.Event,
        nvml: GpuEnergyMeter | None = None,
    ) -> None:
        self.config = config
        self.agent = jobs
        self.outbox = outbox
        self.nvml = nvml
        self.node_power_outbox = NodePowerOutbox(config.outbox_max_samples)
        self.node_power: NodePowerSampler | None = None
        """Samples the whole node's power (every GPU and the host) from registration on."""
        self._node_power_lock = threading.Lock()  # the telemetry loop and shutdown both cut
        self.shutdown = shutdown
        self.agent_url = config.advertise_url or ""
        self.registered: NodeRegistered | None = None
        self.registered_event = threading.Event()
        self.flush_now = threading.Event()
        """Set to send queued telemetry now instead of at the next interval."""
        self.fatal_error: str | None = None
        """Why the agent gave up on its own (the CLI exits 2 with it)."""
        self.on_fatal: Callable[[], None] | None = None
        self.on_registered: Callable[[str], None] | None = None
        """Called with the node's new secret after each successful registration."""
        self.remote_holders: Callable[[], dict[int, int]] | None = None
        """Slot -> job of this node's slots held by workers of jobs whose runner is elsewhere."""

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.config.scheduler_url.rstrip("/"),
            headers={"Authorization": f"Bearer {self.config.token}"},
            timeout=self.config.request_timeout_s,
        )

    def post(
        self, client: httpx.Client, path: str, body: BaseModel, give_up_after_s: float | None
    ) -> httpx.Response:
        """POST with exponential backoff on network errors, 5xx and 429; other answers return."""
        return self.request(client, "POST", path, body, give_up_after_s)

    def get_bundle(self, sha256: str, give_up_after_s: float = 30.0) -> bytes | None:
        """A job's workdir bundle; None when the scheduler has none this node may read (404).
        Raises httpx.HTTPError / RuntimeError when the scheduler cannot be reached in time."""
        with self.client() as client:
            resp = self.request(client, "GET", f"/v1/bundles/{sha256}", None, give_up_after_s)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise RuntimeError(f"bundle {sha256[:12]}: HTTP {resp.status_code} {resp.text[:200]}")
        return resp.content

    def request(
        self,
        client: httpx.Client,
        method: str,
        path: str,
        body: BaseModel | None,
        give_up_after_s: float | None,
    ) -> httpx.Response:
        """A request with exponential backoff on network errors, 5xx and 429."""

        def attempt() -> httpx.Response:
            if body is None:
                resp = client.request(method, path)
            else:
                resp = client.request(
                    method,
                    path,
                    content=body.model_dump_json(),
                    headers={"content-type": "application/json"},
                )
            if resp.status_code >= 500 or resp.status_code == 429:
                raise _Retryable(f"{path}: HTTP {resp.status_code} {resp.text[:200]}")
            return resp

        def give_up(state: RetryCallState) -> bool:
            if self.shutdown.is_set():
                return True
            return give_up_after_s is not None and stop_after_delay(give_up_after_s)(state)

        def note(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("scheduler %s unreachable (%s); retrying", path, exc)

        def sleep(seconds: float) -> None:
            self.shutdown.wait(seconds)  # wakes early when the agent shuts down

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
            gpu_kind=self.config.gpu_kind,
            simulated=self.config.simulated,
            slots=self.config.slots,
            rendezvous_host=self.config.rendezvous_host,
            worker_host_port=(
                self.config.worker_host_port if self.config.rendezvous_host is not None else None
            ),
        )
        while not self.shutdown.is_set():
            try:
                resp = self.post(client, "/v1/nodes/register", body, give_up_after_s=None)
            except (httpx.TransportError, _Retryable) as exc:
                if self.shutdown.is_set():
                    return None
                log.warning("registration failed: %s", exc)
                continue
            if resp.status_code in (200, 201):
                registered = NodeRegistered.model_validate_json(resp.content)
                # The scheduler draws a new secret at every registration; only it is accepted.
                self.config.secret = registered.agent_secret
                if self.on_registered is not None:
                    self.on_registered(registered.agent_secret)
                self.registered = registered
                self.registered_event.set()
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
                self.shutdown.set()
                if self.on_fatal is not None:
                    self.on_fatal()
                return None
            log.error("%s; retrying", refusal)
            self.shutdown.wait(self.config.backoff_cap_s)
        return None

    def heartbeat_loop(self) -> None:
        with self.client() as client:
            if self.register(client) is None:
                return
            while not self.shutdown.is_set():
                assert self.registered is not None
                if self.shutdown.wait(self.registered.heartbeat_interval_s):
                    return
                try:
                    self.heartbeat(client)
                except Exception as exc:  # the loop must survive anything the scheduler does
                    log.warning("heartbeat failed: %s", exc)

    def heartbeat(self, client: httpx.Client) -> None:
        body = Heartbeat(jobs=self.agent.running_jobs())
        reported_stopped = {j.job_id for j in body.jobs if j.gpus == 0} & self.agent.stopped_ids()
        assert self.registered is not None
        path = f"/v1/nodes/{self.config.name}/heartbeat"
        resp = self.post(client, path, body, give_up_after_s=self.registered.heartbeat_interval_s)
        if resp.status_code == 404:
            log.warning("scheduler does not know this node: registering again")
            self.register(client)
            return
        if resp.status_code != 200:
            log.error("heartbeat refused: HTTP %d %s", resp.status_code, resp.text[:300])
            return
        ack = HeartbeatAck.model_validate_json(resp.content)
        self.agent.forget(reported_stopped)
        for job_id in ack.stop_job_ids:
            self.agent.stop_unwanted(job_id)

    def telemetry_loop(self) -> None:
        while not self.registered_event.wait(0.5):
            if self.shutdown.is_set():
                return
        with self.client() as client:
            while True:
                assert self.registered is not None
                self.flush_now.wait(self.registered.telemetry_interval_s)
                self.flush_now.clear()
                if self.shutdown.is_set():
                    return
                self.agent.cut_samples()
                self.cut_node_power()
                try:
                    self.flush(client, give_up_after_s=self.registered.telemetry_interval_s)
                except Exception as exc:
                    log.warning("telemetry not sent (%d queued): %s", len(self.outbox), exc)

    def cut_node_power(self) -> None:
        """Close the node's power interval (every GPU, busy or idle, and the host) into its outbox."""
        with self._node_power_lock:
            self._cut_node_power()

    def _cut_node_power(self) -> None:
        if self.registered is None:
            return
        if self.node_power is None:
            rapl_root = self.config.rapl_root
            self.node_power = NodePowerSampler(
                self.config.slots,
                NodeModel(self.registered.idle_power_per_gpu_w, self.registered.host_power_w),
                nvml=self.nvml,
                dcgm_url=self.config.dcgm_url,
                rapl=None if rapl_root is None else RaplReader(rapl_root),
            )
            return  # the first interval starts now
        holders = {
            slot: job.job_id
            for job in self.agent.running_jobs()
            if job.gpus > 0
            for slot in job.slot_indices
        }
        if self.remote_holders is not None:
            holders |= self.remote_holders()
        try:
            self.node_power_outbox.put(self.node_power.cut(holders))
        except Exception as exc:  # a broken meter must not stop the job telemetry
            log.warning("node power not sampled: %s", exc)

    def flush(self, client: httpx.Client, give_up_after_s: float) -> None:
        """Send queued samples in batches; keep them queued if the scheduler is unreachable."""
        while len(self.outbox) or len(self.node_power_outbox):
            batch = self.outbox.peek(MAX_BATCH)
            power = self.node_power_outbox.peek(MAX_NODE_POWER_BATCH)
            resp = self.post(
                client,
                "/v1/telemetry",
                TelemetryReport(samples=batch, node_power=power, node=self.config.name),
                give_up_after_s,
            )
            if resp.status_code == 200:
                TelemetryAck.model_validate_json(resp.content)
                self.outbox.ack(batch)
                self.node_power_outbox.ack(power)
            elif resp.status_code == 422:
                # Invalid samples would block the queue forever: log them and drop them.
                log.error(
                    "scheduler rejected %d samples and %d node power samples: %s",
                    len(batch),
                    len(power),
                    resp.text[:500],
                )
                self.outbox.ack(batch)
                self.node_power_outbox.ack(power)
            else:
                log.warning("telemetry refused: HTTP %d %s", resp.status_code, resp.text[:300])
                return
