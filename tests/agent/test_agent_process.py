"""The agent as a real process (`python -m worker_agent.cli`) against a real local HTTP fake of
the scheduler's agent endpoints; allocations drive real worker processes (gloo, CPU slots).

The tests share one agent (starting worker processes is the expensive part) and run in order:
each builds on the job state the previous one left.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent.fake_scheduler import FakeScheduler, fake_scheduler, outage
from worker_agent.bundle import pack_directory
from worker_agent.protocol import AGENT_SECRET_HEADER, AgentStatus, RunningJob

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
POWER_W = {1: 200.0, 2: 380.0, 3: 550.0}
LONG_JOB = {"workload": "mlp", "global_batch_size": 16, "total_samples": 16 * 10_000_000}


class _CurrentSecret(httpx.Auth):
    """Sends the secret of the agent's newest registration (it rotates at each one)."""

    def __init__(self, fake: FakeScheduler) -> None:
        self.fake = fake

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers[AGENT_SECRET_HEADER] = self.fake.current_secret()
        yield request


class Node:
    """The agent process under test and a client that carries its secret."""

    def __init__(self, fake: FakeScheduler, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.fake = fake
        self.proc = proc
        self.log = log
        reg = fake.registrations[0]
        self.url = reg.agent_url
        self.http = httpx.Client(base_url=self.url, auth=_CurrentSecret(fake), timeout=120)
        self.acks: dict[tuple[int, int], dict[str, Any]] = {}

    def allocate(
        self, job_id: int, generation: int, slots: list[int], spec: dict[str, Any] | None = None
    ) -> httpx.Response:
        body = {
            "job_id": job_id,
            "generation": generation,
            "slot_indices": slots,
            "spec": spec or LONG_JOB,
            "estimated_power_w": POWER_W,
            "issued_at": datetime.now(UTC).isoformat(),
        }
        resp = self.http.post(f"/jobs/{job_id}/allocation", json=body)
        if resp.status_code == 200:
            self.acks[(job_id, generation)] = resp.json()
        return resp

    def http_status(self) -> AgentStatus:
        return AgentStatus.model_validate(self.http.get("/status").raise_for_status().json())

    def job(self, job_id: int) -> RunningJob:
        return next(j for j in self.http_status().jobs if j.job_id == job_id)

    def wait_step_above(self, job_id: int, step: int, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = self.job(job_id).step
            if now > step:
                return now
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} did not pass step {step}")


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def wait_gone(pids: list[int], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"processes still alive: {pids}"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    log = tmp_path_factory.mktemp("agent") / "agent.log"
    with (
        fake_scheduler(heartbeat_interval_s=0.5, telemetry_interval_s=0.5) as fake,
        log.open("wb") as out,
    ):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker_agent.cli",
                "--scheduler",
                fake.url,
                "--token",
                fake.token,
                "--simulate-gpus",
                "3",
                "--name",
                "test-node",
                "--port",
                "0",
                # These tests restart stopped jobs from step 0 (checkpoints are on by default).
                "--no-checkpoints",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            fake.wait_for(lambda: len(fake.registrations) > 0, timeout_s=60)
            yield Node(fake, proc, log)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_registers_with_secret_and_reachable_url(node: Node) -> None:
    reg = node.fake.registrations[0]
    assert reg.name == "test-node"
    assert reg.simulated and reg.gpu_kind == "simulated"
    assert [s.index for s in reg.slots] == [0, 1, 2]
    assert len(node.fake.current_secret()) >= 16
    assert reg.agent_url.startswith("http://127.0.0.1:") and not reg.agent_url.endswith(":0")
    assert httpx.get(f"{reg.agent_url}/healthz").status_code == 200
    node.fake.wait_for(lambda: len(node.fake.heartbeats) > 0, timeout_s=30)
    assert node.fake.unauthorized == 0


def test_every_call_but_healthz_needs_the_secret(node: Node) -> None:
    assert httpx.get(f"{node.url}/status").status_code == 401
    wrong = {AGENT_SECRET_HEADER: "x" * 43}
    assert httpx.get(f"{node.url}/status", headers=wrong).status_code == 401
    body = {"job_id": 1, "generation": 1, "reason": "test"}
    assert httpx.post(f"{node.url}/jobs/1/stop", json=body, headers=wrong).status_code == 401
    assert node.http.get("/status").status_code == 200


def test_allocation_starts_job_and_telemetry_is_estimated(node: Node) -> None:
    resp = node.allocate(1, 1, [0])
    assert resp.status_code == 200, resp.text
    ack = resp.json()
    assert ack["gpus"] == 1 and ack["layout"] == "dp1-tp1-pp1" and not ack["hot_switch"]
    assert all(alive(p) for p in ack["worker_pids"])
    node.wait_step_above(1, 3)
    node.fake.wait_for(lambda: any(s.step > 0 for s in node.fake.job_samples(1)))
    sample = next(s for s in node.fake.job_samples(1) if s.step > 0)
    assert sample.power_source == "estimated"
    assert sample.gpus == 1 and sample.layout == "dp1-tp1-pp1" and sample.generation == 1
    assert 0 < sample.power_w <= POWER_W[1]
    assert sample.energy_kwh == pytest.approx(sample.power_w * sample.interval_s / 3.6e6)
    assert sample.samples_done == sample.step * 16
    assert sample.loss is not None
    node.fake.wait_for(lambda: any(hb.jobs for hb in node.fake.heartbeats))


def test_resize_hot_switches_and_keeps_worker_of_kept_slot(node: Node) -> None:
    before = node.job(1)
    pid_slot0 = dict(zip(before.slot_indices, before.worker_pids, strict=True))[0]
    resp = node.allocate(1, 2, [0, 1])
    assert resp.status_code == 200, resp.text
    ack = resp.json()
    assert ack["hot_switch"] and ack["gpus"] == 2
    assert ack["switch_s"] > 0 and ack["bytes_moved"] > 0
    assert ack["step"] >= before.step
    after = node.job(1)
    assert dict(zip(after.slot_indices, after.worker_pids, strict=True))[0] == pid_slot0
    assert sorted(after.slot_indices) == [0, 1]
    node.wait_step_above(1, ack["step"])
    # Telemetry after the switch is labelled with the new allocation and never goes back.
    node.fake.wait_for(lambda: any(s.generation == 2 for s in node.fake.job_samples(1)))
    new = [s for s in node.fake.job_samples(1) if s.generation == 2]
    assert all(s.gpus == 2 and s.step >= ack["step"] for s in new)
    steps = [s.step for s in node.fake.job_samples(1)]
    assert steps == sorted(steps)


def test_stale_generation_is_rejected_and_repeat_returns_same_ack(node: Node) -> None:
    stale = node.allocate(1, 1, [0])
    assert stale.status_code == 409
    assert "generation 1" in stale.json()["detail"] and "generation 2" in stale.json()["detail"]
    first = node.acks[(1, 2)]
    again = node.allocate(1, 2, [0, 1])
    assert again.status_code == 200 and again.json() == first
    assert sorted(node.job(1).slot_indices) == [0, 1]


def test_telemetry_is_resent_after_scheduler_errors_and_outage(node: Node) -> None:
    fake = node.fake
    with fake.lock:
        posts = fake.telemetry_posts
        fake.fail_telemetry = 3
    fake.wait_for(lambda: fake.telemetry_posts >= posts + 5, timeout_s=60)
    fake.wait_for(lambda: fake.fail_telemetry == 0)
    # Then the scheduler goes away entirely (connections refused) and comes back.
    before = len(fake.job_samples(1))
    with outage(fake):
        time.sleep(2.0)
    fake.wait_for(lambda: len(fake.job_samples(1)) >= before + 4, timeout_s=30)
    time.sleep(1.0)  # one more interval: the whole backlog has arrived
    samples = [s for s in fake.job_samples(1) if s.generation == 2]
    assert len(samples) >= 8
    # Consecutive samples tile time: each one's interval ends where the previous ended.
    for prev, cur in itertools.pairwise(samples):
        gap_s = (cur.at - prev.at).total_seconds()
        assert gap_s == pytest.approx(cur.interval_s, abs=0.25), (prev, cur)


def test_pause_keeps_state_in_memory_and_resume_continues(node: Node) -> None:
    pids = node.job(1).worker_pids
    resp = node.allocate(1, 3, [])
    assert resp.status_code == 200, resp.text
    ack = resp.json()
    assert ack["gpus"] == 0 and ack["worker_pids"] == [] and ack["layout"] is None
    wait_gone(pids)
    paused_step = ack["step"]
    assert paused_step > 0
    time.sleep(1.0)
    job = node.job(1)
    assert job.step == paused_step and job.gpus == 0
    resp = node.allocate(1, 4, [2])
    assert resp.status_code == 200, resp.text
    assert resp.json()["step"] == paused_step and resp.json()["gpus"] == 1
    node.wait_step_above(1, paused_step)
    node.fake.wait_for(lambda: any(s.generation == 4 for s in node.fake.job_samples(1)))
    assert all(s.step >= paused_step for s in node.fake.job_samples(1) if s.generation == 4)


def test_slot_held_by_another_job_is_refused(node: Node) -> None:
    resp = node.allocate(2, 1, [2], {**LONG_JOB, "total_samples": 160})
    assert resp.status_code == 409
    assert "slot 2 by job 1" in resp.json()["detail"]


def test_stop_frees_slots(node: Node) -> None:
    pids = node.job(1).worker_pids
    resp = node.http.post("/jobs/1/stop", json={"job_id": 1, "generation": 5, "reason": "test"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["gpus"] == 0
    wait_gone(pids)
    again = node.http.post("/jobs/1/stop", json={"job_id": 1, "generation": 5})
    assert again.status_code == 200
    assert node.allocate(1, 4, [0]).status_code == 409  # older than the stop
    # The scheduler may place the job here again with a newer generation: it starts afresh.
    restarted = node.allocate(1, 6, [0])
    assert restarted.status_code == 200, restarted.text
    assert restarted.json()["step"] == 0
    assert not set(restarted.json()["worker_pids"]) & set(pids)
    assert node.http.post("/jobs/1/stop", json={"job_id": 1, "generation": 7}).status_code == 200
    wait_gone(restarted.json()["worker_pids"])


def test_job_finishing_by_itself_reports_finished(node: Node) -> None:
    spec = {"workload": "gpt-tiny", "global_batch_size": 8, "total_samples": 8 * 20}
    resp = node.allocate(2, 1, [2], spec)  # the slot job 1 freed
    assert resp.status_code == 200, resp.text
    pids = resp.json()["worker_pids"]
    node.fake.wait_for(lambda: any(s.finished for s in node.fake.job_samples(2)), timeout_s=90)
    final = next(s for s in node.fake.job_samples(2) if s.finished)
    assert final.step == 20 and final.samples_done == 160
    assert node.fake.job_samples(2)[-1].finished
    wait_gone(pids)
    # The final sample is cut before the workers are released; the job's status follows once
    # the runner has reaped them (a moment after the processes are gone).
    node.fake.wait_for(lambda: node.job(2).finished, timeout_s=30)
    job = node.job(2)
    assert job.finished and job.gpus == 0 and job.worker_pids == []


def test_dead_worker_fails_the_job_and_frees_its_slot(node: Node) -> None:
    resp = node.allocate(4, 1, [1])
    assert resp.status_code == 200, resp.text
    (pid,) = resp.json()["worker_pids"]
    os.kill(pid, signal.SIGKILL)
    node.fake.wait_for(lambda: node.job(4).error is not None, timeout_s=30)
    job = node.job(4)
    assert job.gpus == 0 and job.worker_pids == [] and not job.finished
    assert "died" in (job.error or "") and "Traceback" not in (job.error or "")
    node.fake.wait_for(
        lambda: any(j.job_id == 4 and j.error for hb in node.fake.heartbeats for j in hb.jobs)
    )
    # A newer generation restarts a failed job from scratch (the scheduler decides to retry).
    retried = node.allocate(4, 2, [1])
    assert retried.status_code == 200, retried.text
    assert retried.json()["step"] == 0 and pid not in retried.json()["worker_pids"]
    assert retried.json()["resumed_from"] == "start"
    # A newer generation on exactly the slots it runs on changes nothing: the ack says no run
    # started (the scheduler records no new start), the same workers go on.
    same = node.allocate(4, 3, [1])
    assert same.status_code == 200, same.text
    assert same.json()["resumed_from"] is None and not same.json()["hot_switch"]
    assert same.json()["worker_pids"] == retried.json()["worker_pids"]
    assert node.http.post("/jobs/4/stop", json={"job_id": 4, "generation": 4}).status_code == 200
    wait_gone(retried.json()["worker_pids"])


def test_broken_job_module_fails_the_job_with_its_reason(node: Node, tmp_path: Path) -> None:
    # The bundle holds a module that does not import: the job fails, the agent carries on.
    (tmp_path / "user_job_broken.py").write_text("import no_such_module_here\n")
    bundle = pack_directory(tmp_path)
    node.fake.bundles[bundle.sha256] = bundle.data
    spec = {
        "workload": "user_job_broken:job",
        "global_batch_size": 4,
        "total_samples": 400,
        "bundle_sha256": bundle.sha256,
    }
    resp = node.allocate(7, 1, [1], spec)
    assert resp.status_code == 422, resp.text
    assert "cannot import job module 'user_job_broken'" in resp.json()["detail"]
    assert "no_such_module_here" in resp.json()["detail"]
    job = node.job(7)
    assert job.job_error and job.gpus == 0 and "no_such_module_here" in (job.error or "")
    node.fake.wait_for(
        lambda: any(j.job_id == 7 and j.job_error for hb in node.fake.heartbeats for j in hb.jobs)
    )
    # A bundle the scheduler does not have fails the same way, naming the bundle.
    missing = {**spec, "bundle_sha256": "0" * 64}
    resp = node.allocate(8, 1, [1], missing)
    assert resp.status_code == 422 and "not on the scheduler" in resp.json()["detail"]
    assert node.http.get("/healthz").status_code == 200
    for job_id in (7, 8):
        stop = {"job_id": job_id, "generation": 2}
        assert node.http.post(f"/jobs/{job_id}/stop", json=stop).status_code == 200


FLAKY_JOB = """
import torch

calls = 0


def loss(model, batch):
    global calls
    calls += 1
    if calls > 3:
        raise ValueError("the data ran dry")
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def job():
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    return {"model": Net, "dataset": data, "loss": loss}
"""


def test_job_code_raising_while_training_fails_the_job_for_good(node: Node, tmp_path: Path) -> None:
    (tmp_path / "user_job_flaky.py").write_text(FLAKY_JOB)
    bundle = pack_directory(tmp_path)
    node.fake.bundles[bundle.sha256] = bundle.data
    spec = {
        "workload": "user_job_flaky:job",
        "global_batch_size": 4,
        "total_samples": 4_000,
        "bundle_sha256": bundle.sha256,
    }
    resp = node.allocate(9, 1, [1], spec)
    assert resp.status_code == 200, resp.text
    # The failure is recorded first, then the workers released.
    node.fake.wait_for(lambda: node.job(9).error is not None and node.job(9).gpus == 0, 60)
    job = node.job(9)
    assert job.job_error and job.gpus == 0 and job.worker_pids == []
    assert "the job's model or loss function raised ValueError: the data ran dry" in (
        job.error or ""
    )
    assert node.http.post("/jobs/9/stop", json={"job_id": 9, "generation": 2}).status_code == 200


def test_jobs_the_scheduler_no_longer_wants_are_stopped_and_forgotten(node: Node) -> None:
    # Job 2 finished by itself; job 5 was allocated 0 slots (known, never started).
    assert node.allocate(5, 1, []).status_code == 200
    ids = {j.job_id for j in node.http_status().jobs}
    assert {2, 5} <= ids
    with node.fake.lock:
        node.fake.stop_job_ids = [2, 5]
    node.fake.wait_for(lambda: not {2, 5} & {j.job_id for j in node.http_status().jobs})
    with node.fake.lock:
        node.fake.stop_job_ids = []
    # The generation it ended at cannot run it again (a newer one would restart it afresh).
    assert node.allocate(5, 1, [0]).status_code == 409
    stop = node.http.post("/jobs/5/stop", json={"job_id": 5, "generation": 2})
    assert stop.status_code == 200  # a repeated stop stays harmless
    # So is a stop for a job this agent never ran (e.g. the agent restarted): it is not running.
    never = node.http.post("/jobs/77/stop", json={"job_id": 77, "generation": 3})
    assert never.status_code == 200 and never.json()["gpus"] == 0


def test_heartbeat_404_makes_agent_register_again(node: Node) -> None:
    fake = node.fake
    count = len(fake.registrations)
    old_secret = fake.current_secret()
    with fake.lock:
        fake.forget_node = True
    fake.wait_for(lambda: len(fake.registrations) > count, timeout_s=30)
    # The new registration drew a new secret: the agent takes only that one from now on.
    new_secret = fake.current_secret()
    assert new_secret != old_secret
    stale = httpx.get(f"{node.url}/status", headers={AGENT_SECRET_HEADER: old_secret})
    assert stale.status_code == 401
    assert node.http.get("/status").status_code == 200


def test_sigterm_stops_workers_and_exits_zero(node: Node) -> None:
    resp = node.allocate(3, 1, [0])
    assert resp.status_code == 200, resp.text
    workers = resp.json()["worker_pids"]
    below = descendants(node.proc.pid)
    assert set(workers) <= below
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=60) == 0, node.log.read_text()[-3000:]
    wait_gone(sorted(below))
