"""Power readings (NVML or the scheduler's estimate) and the bounded outbox of unsent samples."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from energy_model.power import V100_POWER
from worker_agent.protocol import TelemetrySample

log = logging.getLogger(__name__)

J_PER_KWH = 3.6e6

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


class NvmlMeter:
    """Reads board energy (or power) of NVIDIA GPUs by index through NVML."""

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

    def device_count(self) -> int:
        """Number of GPUs NVML sees."""
        with self._lock:
            return int(self._nvml.nvmlDeviceGetCount())

    def describe(self, index: int) -> tuple[str, str | None, int]:
        """(name, uuid, memory_mb) of one GPU."""
        with self._lock:
            h = self._nvml.nvmlDeviceGetHandleByIndex(index)
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
                h = self._nvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    total_mj += int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h))
                except self._nvml.NVMLError:
                    return None
        return total_mj / 1000.0

    def power_w(self, indices: Sequence[int]) -> float:
        """Instantaneous board power of these GPUs in watts."""
        with self._lock:
            return sum(
                self._nvml.nvmlDeviceGetPowerUsage(self._nvml.nvmlDeviceGetHandleByIndex(i))
                / 1000.0
                for i in indices
            )


class Outbox:
    """Thread-safe, bounded FIFO of samples not yet acknowledged by the scheduler.

    Samples leave only when the scheduler acknowledged them (sample_id makes resends idempotent);
    when full, the oldest are dropped and counted, so a long outage cannot exhaust memory.
    """

    def __init__(self, max_samples: int = 10_000) -> None:
        self._items: deque[TelemetrySample] = deque()
        self._max = max_samples
        self._lock = threading.Lock()
        self.dropped = 0

    def put(self, sample: TelemetrySample) -> None:
        """Queue one sample (dropping the oldest when full)."""
        with self._lock:
            if len(self._items) >= self._max:
                self._items.popleft()
                self.dropped += 1
                log.warning(
                    "telemetry outbox full: dropped the oldest sample (%d so far)", self.dropped
                )
            self._items.append(sample)

    def peek(self, n: int) -> list[TelemetrySample]:
        """The oldest `n` samples, left in the queue."""
        with self._lock:
            return [self._items[i] for i in range(min(n, len(self._items)))]

    def ack(self, samples: Sequence[TelemetrySample]) -> None:
        """Remove these samples (the scheduler stored or already had them)."""
        ids = {s.sample_id for s in samples}
        with self._lock:
            self._items = deque(s for s in self._items if s.sample_id not in ids)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
