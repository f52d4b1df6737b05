"""Node power sampling: every GPU of the node (busy or idle) and its host, each reading labelled.

Sources, best first:
- GPUs: NVML energy counters (or power x time), else a DCGM exporter's Prometheus endpoint
  (`DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`, mJ since boot, else `DCGM_FI_DEV_POWER_USAGE`, W),
  else the node model (`idle_power_per_gpu_w`, an estimate) for idle GPUs. A busy GPU nothing
  measures gets no reading: its job's own telemetry carries the estimate.
- Host: RAPL (`/sys/class/powercap/intel-rapl:N`, one reading per CPU package), else the node
  model's host watts (an estimate).

A sample covers [previous cut, this cut); a GPU's reading names the job holding it at the cut.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from worker_agent.protocol import GpuSlotInfo, NodePowerSample, NodePowerSource, PowerReading

log = logging.getLogger("greenflow.agent")

RAPL_ROOT = Path("/sys/class/powercap")
DCGM_POWER = "DCGM_FI_DEV_POWER_USAGE"
DCGM_ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"


class GpuEnergyMeter(Protocol):
    """What the sampler needs from NVML (worker_agent.telemetry.NvmlMeter has it)."""

    def energy_j(self, indices: Sequence[int]) -> float | None: ...

    def power_w(self, indices: Sequence[int]) -> float: ...


@dataclass(frozen=True)
class NodeModel:
    """The estimate used where nothing measures."""

    idle_power_per_gpu_w: float
    host_power_w: float


class RaplReader:
    """Energy counters of the CPU packages under /sys/class/powercap (zones `intel-rapl:N`).

    Only top-level zones are read: their subzones (cores, uncore, dram inside a package) are
    parts of the package's own count, so adding them would charge watts twice."""

    def __init__(self, root: Path = RAPL_ROOT) -> None:
        self.zones: list[tuple[str, Path, int]] = []
        if not root.is_dir():
            return
        for zone in sorted(root.glob("intel-rapl:*")):
            if zone.name.count(":") != 1:
                continue
            try:
                name = (zone / "name").read_text().strip() or zone.name
                max_uj = int((zone / "max_energy_range_uj").read_text())
                int((zone / "energy_uj").read_text())  # readable at all (root-only since 2020)
            except (OSError, ValueError) as exc:
                log.info("RAPL zone %s not readable (%s): host power will be estimated", zone, exc)
                self.zones = []
                return
            self.zones.append((name, zone / "energy_uj", max_uj))

    def read_uj(self) -> dict[str, tuple[int, int]] | None:
        """{package name: (counter uJ, wrap range uJ)}, or None when unreadable now."""
        try:
            return {name: (int(path.read_text()), max_uj) for name, path, max_uj in self.zones}
        except (OSError, ValueError):
            return None


def parse_dcgm(text: str) -> dict[str, dict[str, float]]:
    """{gpu key: {metric: value}} from a DCGM exporter page; keys are `uuid:<UUID>` and `gpu:<i>`."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        # The parser names a counter's samples `<name>_total`; the family keeps the bare name.
        if family.name not in (DCGM_POWER, DCGM_ENERGY):
            continue
        for sample in family.samples:
            if sample.name not in (family.name, family.name + "_total"):
                continue
            keys = []
            if sample.labels.get("UUID"):
                keys.append(f"uuid:{sample.labels['UUID']}")
            if sample.labels.get("gpu"):
                keys.append(f"gpu:{sample.labels['gpu']}")
            for key in keys:
                out.setdefault(key, {})[family.name] = float(sample.value)
    return out


class NodePowerSampler:
    """Cuts one NodePowerSample per call from the best source each GPU and the host have."""

    def __init__(
        self,
        slots: Sequence[GpuSlotInfo],
        model: NodeModel,
        *,
        nvml: GpuEnergyMeter | None = None,
        dcgm_url: str | None = None,
        rapl: RaplReader | None = None,
        now: datetime | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        self.slots = list(slots)
        self.model = model
        self.nvml = nvml
        self.dcgm_url = dcgm_url
        self.rapl = rapl if rapl is not None and rapl.zones else None
        self.timeout_s = timeout_s
        self._last_at = now or datetime.now(UTC)
        self._gpu_j: dict[int, float] = {}  # last NVML/DCGM energy counter per slot (J)
        self._rapl_uj: dict[str, int] = {}
        if self.rapl is not None:
            first = self.rapl.read_uj()
            self._rapl_uj = {k: v for k, (v, _) in (first or {}).items()}

    def _gpu_from_nvml(self, slot: int, interval_s: float) -> float | None:
        assert self.nvml is not None
        try:
            total = self.nvml.energy_j([slot])
            last = self._gpu_j.get(slot)
            if total is not None:
                self._gpu_j[slot] = total
                if last is not None and total >= last:
                    return total - last
            return self.nvml.power_w([slot]) * interval_s
        except Exception as exc:  # a GPU fallen off the bus must not stop the sampler
            log.warning("NVML reading of GPU %d failed: %s", slot, exc)
            return None

    def _dcgm_page(self) -> dict[str, dict[str, float]] | None:
        assert self.dcgm_url is not None
        try:
            resp = httpx.get(self.dcgm_url, timeout=self.timeout_s)
            resp.raise_for_status()
            return parse_dcgm(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("DCGM exporter %s unreadable: %s", self.dcgm_url, exc)
            return None

    def _gpu_from_dcgm(
        self, page: Mapping[str, Mapping[str, float]], slot: GpuSlotInfo, interval_s: float
    ) -> float | None:
        values = page.get(f"uuid:{slot.uuid}") if slot.uuid else None
        values = values or page.get(f"gpu:{slot.index}")
        if not values:
            return None
        if DCGM_ENERGY in values:
            total_j = values[DCGM_ENERGY] / 1000.0
            last = self._gpu_j.get(slot.index)
            self._gpu_j[slot.index] = total_j
            if last is not None and total_j >= last:
                return total_j - last
        if DCGM_POWER in values:
            return values[DCGM_POWER] * interval_s
        return None

    def _host(self, interval_s: float) -> list[PowerReading]:
        if self.rapl is not None:
            now = self.rapl.read_uj()
            if now is not None:
                out = []
                for name, (uj, wrap) in now.items():
                    last = self._rapl_uj.get(name, uj)
                    # The counter wraps at max_energy_range_uj.
                    delta = uj - last if uj >= last else uj + wrap - last
                    self._rapl_uj[name] = uj
                    out.append(
                        PowerReading(
                            component="host", device=name[:32], energy_j=delta / 1e6, source="rapl"
                        )
                    )
                return out
        return [
            PowerReading(
                component="host",
                device="host",
                energy_j=self.model.host_power_w * interval_s,
                source="estimated",
            )
        ]

    def cut(self, holders: Mapping[int, int], now: datetime | None = None) -> NodePowerSample:
        """The node's energy since the previous cut; `holders`: slot index -> job holding it."""
        at = now or datetime.now(UTC)
        interval_s = max((at - self._last_at).total_seconds(), 1e-6)
        self._last_at = at
        page = self._dcgm_page() if self.nvml is None and self.dcgm_url else None
        readings: list[PowerReading] = []
        for slot in self.slots:
            job_id = holders.get(slot.index)
            energy: float | None = None
            source: NodePowerSource = "estimated"
            if self.nvml is not None:
                energy, source = self._gpu_from_nvml(slot.index, interval_s), "nvml"
            elif page is not None:
                energy, source = self._gpu_from_dcgm(page, slot, interval_s), "dcgm"
            if energy is None:
                if job_id is not None:
                    continue  # the job's own telemetry estimates a busy unmeasured GPU
                energy, source = self.model.idle_power_per_gpu_w * interval_s, "estimated"
            readings.append(
                PowerReading(
                    component="gpu",
                    device=str(slot.index),
                    job_id=job_id,
                    energy_j=max(0.0, energy),
                    source=source,
                )
            )
        readings.extend(self._host(interval_s))
        return NodePowerSample(
            sample_id=f"np-{uuid.uuid4().hex}", at=at, interval_s=interval_s, readings=readings
        )
