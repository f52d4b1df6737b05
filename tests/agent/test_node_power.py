"""Node power sampling (issue 22): every GPU busy or idle and the host, each reading labelled
with its source: NVML, a DCGM exporter (a local fake one), RAPL (a fake sysfs tree), or the
node model as an estimate."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.agent.fake_scheduler import fake_scheduler
from worker_agent.agent import AgentConfig
from worker_agent.node_power import NodeModel, NodePowerSampler, RaplReader, parse_dcgm
from worker_agent.protocol import GpuSlotInfo, NodePowerSample, RunningJob
from worker_agent.scheduler_link import SchedulerLink
from worker_agent.telemetry import Outbox

T0 = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
MODEL = NodeModel(idle_power_per_gpu_w=60.0, host_power_w=150.0)


def _by_device(sample: NodePowerSample) -> dict[str, tuple[float, str, int | None]]:
    return {r.device: (r.energy_j, r.source, r.job_id) for r in sample.readings}


class FakeNvml:
    """Energy counters per GPU that advance as the test says."""

    def __init__(self, joules: dict[int, float], counters: bool = True) -> None:
        self.joules = joules
        self.counters = counters
        self.watts = dict.fromkeys(joules, 100.0)

    def energy_j(self, indices: Sequence[int]) -> float | None:
        return sum(self.joules[i] for i in indices) if self.counters else None

    def power_w(self, indices: Sequence[int]) -> float:
        return sum(self.watts[i] for i in indices)


def test_nvml_counters_give_every_gpu_and_the_model_the_host() -> None:
    slots = [GpuSlotInfo(index=i) for i in range(3)]
    nvml = FakeNvml({0: 1000.0, 1: 5000.0, 2: 70.0})
    sampler = NodePowerSampler(slots, MODEL, nvml=nvml, now=T0)
    # First interval: no previous counter yet, so power x time.
    first = sampler.cut({0: 42}, now=T0 + timedelta(seconds=10))
    assert _by_device(first)["0"] == (1000.0, "nvml", 42)
    nvml.joules = {0: 3500.0, 1: 5600.0, 2: 370.0}
    second = _by_device(sampler.cut({0: 42}, now=T0 + timedelta(seconds=20)))
    assert second["0"] == (2500.0, "nvml", 42)
    assert second["1"] == (600.0, "nvml", None)  # idle, measured
    assert second["2"] == (300.0, "nvml", None)
    assert second["host"] == (1500.0, "estimated", None)  # 150 W x 10 s, no RAPL here


def test_without_meters_idle_gpus_are_estimated_and_busy_ones_left_to_job_telemetry() -> None:
    slots = [GpuSlotInfo(index=i) for i in range(2)]
    sampler = NodePowerSampler(slots, MODEL, now=T0)
    readings = _by_device(sampler.cut({1: 7}, now=T0 + timedelta(seconds=5)))
    assert readings == {"0": (300.0, "estimated", None), "host": (750.0, "estimated", None)}


def _rapl_zone(root: Path, name: str, zone: str, uj: int, wrap: int) -> Path:
    path = root / zone
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{uj}\n")
    (path / "max_energy_range_uj").write_text(f"{wrap}\n")
    return path


def test_rapl_packages_replace_the_host_estimate_and_survive_a_counter_wrap(
    tmp_path: Path,
) -> None:
    pkg0 = _rapl_zone(tmp_path, "package-0", "intel-rapl:0", 1_000_000, 10_000_000)
    pkg1 = _rapl_zone(tmp_path, "package-1", "intel-rapl:1", 9_500_000, 10_000_000)
    # A subzone is part of its package's count: never read on its own.
    _rapl_zone(tmp_path, "core", "intel-rapl:0:0", 5, 10_000_000)
    rapl = RaplReader(tmp_path)
    assert [name for name, _, _ in rapl.zones] == ["package-0", "package-1"]
    sampler = NodePowerSampler([GpuSlotInfo(index=0)], MODEL, rapl=rapl, now=T0)
    (pkg0 / "energy_uj").write_text("3000000\n")
    (pkg1 / "energy_uj").write_text("500000\n")  # wrapped past 10 J
    readings = _by_device(sampler.cut({}, now=T0 + timedelta(seconds=1)))
    assert readings["package-0"] == (2.0, "rapl", None)
    assert readings["package-1"] == (1.0, "rapl", None)
    assert "host" not in readings


def test_unreadable_rapl_falls_back_to_the_estimate(tmp_path: Path) -> None:
    assert RaplReader(tmp_path / "absent").zones == []
    zone = _rapl_zone(tmp_path, "package-0", "intel-rapl:0", 1, 10)
    (zone / "energy_uj").unlink()
    assert RaplReader(tmp_path).zones == []


DCGM_PAGE = """\
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{{gpu="0",UUID="GPU-aaa",device="nvidia0",modelName="NVIDIA H100"}} 250.5
DCGM_FI_DEV_POWER_USAGE{{gpu="1",UUID="GPU-bbb",device="nvidia1",modelName="NVIDIA H100"}} 61.0
# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).
# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{gpu="0",UUID="GPU-aaa",device="nvidia0",modelName="NVIDIA H100"}} {energy0}
"""


class FakeExporter:
    """A DCGM exporter's /metrics on loopback; gpu 1 exports power only (no energy counter)."""

    def __init__(self) -> None:
        self.energy0_mj = 1_000_000
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = DCGM_PAGE.format(energy0=exporter.energy0_mj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter() -> Iterator[FakeExporter]:
    fake = FakeExporter()
    yield fake
    fake.close()


def test_dcgm_exporter_energy_counter_then_power(exporter: FakeExporter) -> None:
    slots = [GpuSlotInfo(index=0, uuid="GPU-aaa"), GpuSlotInfo(index=1), GpuSlotInfo(index=2)]
    sampler = NodePowerSampler(slots, MODEL, dcgm_url=exporter.url, now=T0)
    first = _by_device(sampler.cut({0: 3}, now=T0 + timedelta(seconds=2)))
    # No previous counter: the power gauge times the interval.
    assert first["0"] == (501.0, "dcgm", 3)
    exporter.energy0_mj += 400_000
    second = _by_device(sampler.cut({0: 3}, now=T0 + timedelta(seconds=4)))
    assert second["0"] == (400.0, "dcgm", 3)  # the counter's 400 J, not 250.5 W x 2 s
    assert second["1"] == (122.0, "dcgm", None)  # power only: 61 W x 2 s
    # GPU 2 is not in the exporter's page: the node model's idle estimate.
    assert second["2"] == (120.0, "estimated", None)


def test_an_unreachable_exporter_degrades_to_the_estimate() -> None:
    sampler = NodePowerSampler(
        [GpuSlotInfo(index=0)], MODEL, dcgm_url="http://127.0.0.1:9/metrics", now=T0, timeout_s=0.5
    )
    readings = _by_device(sampler.cut({}, now=T0 + timedelta(seconds=1)))
    assert readings["0"] == (60.0, "estimated", None)


def test_parse_dcgm_keys_by_uuid_and_index() -> None:
    page = parse_dcgm(DCGM_PAGE.format(energy0=5))
    assert page["uuid:GPU-aaa"] == {
        "DCGM_FI_DEV_POWER_USAGE": 250.5,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 5.0,
    }
    assert page["gpu:1"] == {"DCGM_FI_DEV_POWER_USAGE": 61.0}


class _Jobs:
    """The job book the link reads holders from: one job on slot 1."""

    def running_jobs(self) -> list[RunningJob]:
        return [
            RunningJob(
                job_id=5,
                generation=1,
                gpus=1,
                slot_indices=[1],
                layout="dp1",
                step=0,
                samples_done=0,
                worker_pids=[],
            )
        ]

    def stopped_ids(self) -> set[int]:
        return set()

    def forget(self, job_ids: set[int]) -> None:
        pass

    def stop_unwanted(self, job_id: int) -> None:
        pass

    def cut_samples(self) -> None:
        pass


def test_the_link_samples_the_node_with_the_registered_model_and_sends_it() -> None:
    with fake_scheduler() as fake:
        config = AgentConfig(
            scheduler_url=fake.url,
            token=fake.token,
            name="node-1",
            slots=[GpuSlotInfo(index=0), GpuSlotInfo(index=1)],
            advertise_url="http://127.0.0.1:9",
            rapl_root=None,
        )
        link = SchedulerLink(config, _Jobs(), Outbox(), threading.Event())
        with link.client() as client:
            assert link.register(client) is not None
            link.cut_node_power()  # the first interval starts at registration
            assert len(link.node_power_outbox) == 0
            time.sleep(0.05)
            link.cut_node_power()
            link.flush(client, give_up_after_s=5.0)
        assert len(link.node_power_outbox) == 0
        (sample,) = fake.node_power.values()
        readings = {r.device: r for r in sample.readings}
        # Slot 0 idle: the scheduler's node model (60 W); slot 1 is the job's and unmeasured, so
        # its own telemetry carries it; the host from the model (150 W, no RAPL).
        assert set(readings) == {"0", "host"}
        assert readings["0"].source == "estimated" and readings["0"].job_id is None
        assert readings["0"].energy_j == pytest.approx(60.0 * sample.interval_s)
        assert readings["host"].energy_j == pytest.approx(150.0 * sample.interval_s)
