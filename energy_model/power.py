"""GPU power specs and the power of a job's GPUs at a given throughput.

Model (per GPU): idle_w + (busy_w - idle_w) * utilisation ** exponent, where utilisation is the
GPU's share of the work relative to one GPU running the whole global batch alone. A job on more
GPUs than it can use pays idle power on each of them for little extra throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from energy_model.fit import PowerParams


@dataclass(frozen=True)
class GpuPowerSpec:
    """Power characteristics of one GPU model."""

    name: str
    idle_w: float  # power of a GPU that holds a job but does no work
    max_w: float  # board power limit (TDP)
    busy_w: float  # average power of a typical DL training step at full utilisation
    exponent: float  # shape of power vs utilisation (1 = linear, <1 = concave)

    def __post_init__(self) -> None:
        if not 0 < self.idle_w < self.busy_w <= self.max_w:
            raise ValueError(
                f"{self.name}: need 0 < idle_w < busy_w <= max_w, got "
                f"{self.idle_w}, {self.busy_w}, {self.max_w}"
            )
        if self.exponent <= 0:
            raise ValueError(f"{self.name}: exponent must be positive, got {self.exponent}")

    @property
    def dynamic_w(self) -> float:
        """Power above idle at full utilisation."""
        return self.busy_w - self.idle_w

    def params(self, busy_w: float | None = None) -> PowerParams:
        """The per-GPU power model of this GPU (optionally for a workload's own busy power)."""
        busy = self.busy_w if busy_w is None else min(busy_w, self.max_w)
        return PowerParams(self.idle_w, max(busy - self.idle_w, 1e-3), self.exponent)


# V100 (PCIe, 250 W board limit — the highest power limit in Zeus' summary_power_v100.csv).
# idle_w, busy_w and exponent: one fit of idle + dyn * u**exp to every workload of
# ../shared/data/zeus/summary_power_v100.csv at the 250 W limit (u = epoch-time ratio to the
# fastest batch size of that workload); regenerate with `python -m energy_model.priors_build`.
# The fitted idle (34 W) matches the flat ~35 W of the NCF rows, which barely load the GPU.
V100_POWER = GpuPowerSpec(name="V100", idle_w=34.0, max_w=250.0, busy_w=191.0, exponent=0.90)

# A100 SXM4: 400 W TDP from NVIDIA's A100 datasheet. Zeus has no A100 rows, so idle and busy
# power keep the V100 fit's fractions of the board limit (34/250 = 0.136, 191/250 = 0.764),
# giving 54 W idle (in line with the 50-60 W commonly reported by nvidia-smi for an idle A100)
# and 306 W busy; the shape exponent is the V100 fit's.
A100_POWER = GpuPowerSpec(name="A100", idle_w=54.0, max_w=400.0, busy_w=306.0, exponent=0.90)

# A40: 300 W TDP (NVIDIA A40 datasheet); idle/busy/exponent fitted like the V100 on
# summary_power_a40.csv at its 300 W limit.
A40_POWER = GpuPowerSpec(name="A40", idle_w=87.0, max_w=300.0, busy_w=221.0, exponent=1.20)

GPU_POWER_SPECS: dict[str, GpuPowerSpec] = {
    spec.name.lower(): spec for spec in (V100_POWER, A100_POWER, A40_POWER)
}


def utilisation(gpus: int, samples_per_s: float, single_gpu_samples_per_s: float) -> float:
    """Per-GPU utilisation: each GPU's samples/s relative to one GPU doing the whole batch."""
    if gpus <= 0:
        raise ValueError(f"gpus must be positive, got {gpus}")
    if single_gpu_samples_per_s <= 0:
        raise ValueError(
            f"single_gpu_samples_per_s must be positive, got {single_gpu_samples_per_s}"
        )
    return max(samples_per_s, 0.0) / (gpus * single_gpu_samples_per_s)


def job_power_w(
    gpus: int,
    samples_per_s: float,
    single_gpu_samples_per_s: float,
    gpu: GpuPowerSpec = A100_POWER,
    busy_w: float | None = None,
) -> float:
    """Total average power (W) of `gpus` GPUs that together do `samples_per_s`."""
    u = utilisation(gpus, samples_per_s, single_gpu_samples_per_s)
    return gpus * gpu.params(busy_w).per_gpu_w(u)
