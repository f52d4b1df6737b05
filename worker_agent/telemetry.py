"""Power readings (NVML or the scheduler's estimate) and the bounded outbox of unsent samples."""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from energy_model.emissions import J_PER_KWH
from energy_model.power import V100_POWER
from worker_agent.protocol import NodePowerSample, TelemetrySample

log = logging.getLogger(__name__)

IDLE_SHARE = V100_POWER.idle_w / V100_POWER.busy_w
"""Share of a training GPU's power it draws while it holds a job but computes nothing.

From the V100 fit of energy_model.power (34 W idle of 191 W busy); used for simulated slots only.
"""

DEFAULT_SLOT_POWER_W = V100_POWER.busy_w
"""Busy watts of one simulated slot when the scheduler sent no power model for the job."""


def model_power_w(estimated_power_w: Mapping[int, float], gpus: int) -> float:
    """Busy watts of a job on `gpus` GPUs from the scheduler's model (nearest count, per-GPU scaled)."""
    if gpus <= 0:
        return 0.0
    if gpus in estimated_power_w:
        return float(estimated_power_w[gpus])
    known = sorted(k for k in estimated_power_w if k > 0)
    if not known:
        return DEFAULT_SLOT_POWER_W * gpus
    # No entry for this count: scale the nearest known count's per-GPU power.
    nearest = min(known, key=lambda k: (abs(k - gpus), k))
    return float(estimated_power_w[nearest]) / nearest * gpus


def estimated_power_w(
    estimated_power_w: Mapping[int, float], gpus: int, busy_fraction: float
) -> float:
    """Average watts over an interval in which the workers trained `busy_fraction` of the time."""
    busy = min(1.0, max(0.0, busy_fraction))
    return model_power_w(estimated_power_w, gpus) * (IDLE_SHARE + (1.0 - IDLE_SHARE) * busy)


def energy_kwh(power_w: float, interval_s: float) -> float:
    """Energy of `power_w` held for `interval_s`."""
    return power_w * interval_s / J_PER_KWH


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used (no driver, no library, or no such device)."""


def visible_devices(env: str | None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES (indices or GPU-/MIG- UUIDs), None when unset.

    CUDA numbers the visible devices 0..n-1 in this order; NVML numbers every device of the
    machine, so CUDA device i is NVML device `entries[i]` (an index, or the one with that UUID).
    CUDA stops at the first invalid entry, and so does this.
    """
    if env is None:
        return None
    out: list[str] = []
    for raw in env.split(","):
        entry = raw.strip()
        if not entry or entry == "-1":
            break
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        out.append(entry)
    return out


def nvml_indices(entries: list[str] | None, count: int, uuid_index: Mapping[str, int]) -> list[int]:
    """NVML index of each CUDA device 0..count-1 (`uuid_index`: NVML's UUID -> index)."""
    if entries is None:
        return list(range(count))
    out: list[int] = []
    for entry in entries[:count]:
        if entry.isdigit():
            out.append(int(entry))
            continue
        # CUDA accepts a unique UUID prefix.
        matches = [i for u, i in uuid_index.items() if u.startswith(entry)]
        if len(matches) != 1:
            raise NvmlUnavailable(f"CUDA_VISIBLE_DEVICES entry {entry!r} names no single GPU")
        out.append(matches[0])
    return out


class NvmlMeter:
    """Reads board energy (or power) of NVIDIA GPUs through NVML, by CUDA device index.

    CUDA device i (what slot i and the workers use) is mapped to its NVML index through
    CUDA_VISIBLE_DEVICES, so readings belong to the GPUs the jobs run on.
    """

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a declared dependency
            raise NvmlUnavailable("nvidia-ml-py is not installed") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML init failed: {exc}") from exc
        self._nvml: Any = pynvml
        self._lock = threading.Lock()
        count = int(pynvml.nvmlDeviceGetCount())
        uuids: dict[str, int] = {}
        for i in range(count):
            u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            uuids[u.decode() if isinstance(u, bytes) else str(u)] = i
        entries = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._index = nvml_indices(entries, count if entries is None else len(entries), uuids)
        """NVML index of each CUDA device."""

    def _handle(self, cuda_index: int) -> Any:
        return self._nvml.nvmlDeviceGetHandleByIndex(self._index[cuda_index])

    def device_count(self) -> int:
        """Number of GPUs visible to CUDA that NVML can read."""
        return len(self._index)

    def describe(self, index: int) -> tuple[str, str | None, int]:
        """(name, uuid, memory_mb) of CUDA device `index`."""
        with self._lock:
            h = self._handle(index)
            name = self._nvml.nvmlDeviceGetName(h)
            uuid = self._nvml.nvmlDeviceGetUUID(h)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
        name = name.decode() if isinstance(name, bytes) else str(name)
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        return name, uuid, int(mem.total // 2**20)

    def energy_j(self, indices: Sequence[int]) -> float | None:
        """Total energy counter of these GPUs in joules, or None if a GPU lacks the counter."""
        total_mj = 0
        with self._lock:
            for i in indices:
                h = self._handle(i)
                try:
                    total_mj += int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h))
                except self._nvml.NVMLError:
                    return None
        return total_mj / 1000.0

    def power_w(self, indices: Sequence[int]) -> float:
        """Instantaneous board power of these GPUs in watts."""
        with self._lock:
            return sum(
                self._nvml.nvmlDeviceGetPowerUsage(self._handle(i)) / 1000.0 for i in indices
            )


class _Identified(Protocol):
    @property
    def sample_id(self) -> str: ...


SampleT = TypeVar("SampleT", bound=_Identified)


class SampleOutbox(Generic[SampleT]):
    """Thread-safe, bounded FIFO of samples not yet acknowledged by the scheduler.

    Samples leave only when the scheduler acknowledged them (sample_id makes resends idempotent);
    when full, the oldest are dropped and counted, so a long outage cannot exhaust memory.
    """

    def __init__(self, max_samples: int = 10_000) -> None:
        self._items: deque[SampleT] = deque()
        self._max = max_samples
        self._lock = threading.Lock()
        self.dropped = 0

    def put(self, sample: SampleT) -> None:
        """Queue one sample (dropping the oldest when full)."""
        with self._lock:
            if len(self._items) >= self._max:
                self._items.popleft()
                self.dropped += 1
                log.warning(
                    "telemetry outbox full: dropped the oldest sample (%d so far)", self.dropped
                )
            self._items.append(sample)

    def peek(self, n: int) -> list[SampleT]:
        """The oldest `n` samples, left in the queue."""
        with self._lock:
            return [self._items[i] for i in range(min(n, len(self._items)))]

    def ack(self, samples: Sequence[SampleT]) -> None:
        """Remove these samples (the scheduler stored or already had them)."""
        ids = {s.sample_id for s in samples}
        with self._lock:
            self._items = deque(s for s in self._items if s.sample_id not in ids)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class Outbox(SampleOutbox[TelemetrySample]):
    """The outbox of job telemetry samples."""


class NodePowerOutbox(SampleOutbox[NodePowerSample]):
    """The outbox of node power samples (each covers the whole node over one interval)."""
