"""Per-job throughput and power at each GPU count: priors per workload preset, online refits."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from energy_model.fit import (
    DEFAULT_OBS_REL_STD,
    PowerObs,
    PowerParams,
    ThroughputObs,
    ThroughputParams,
    fit_power,
    fit_throughput_layouts,
)
from energy_model.power import A100_POWER, GpuPowerSpec
from energy_model.priors_data import BUSY_FRACTION, POWER_REL_STD, THROUGHPUT_PRIORS

GENERIC_WORKLOAD = "generic"
# Telemetry power sources that are the scheduler's own estimate, not a measurement.
ESTIMATED_POWER_SOURCES = frozenset({"estimated"})
# Unknown workloads (user entrypoints) get the geometric mean of the presets, far less certain.
GENERIC_THROUGHPUT_REL_STD = 0.5
# Log-space prior std of the model coefficients: presets are measured, generic is a guess.
PRESET_PARAM_LOG_STD = 0.5
GENERIC_PARAM_LOG_STD = 1.5
# Log-space prior std of (idle_w, dynamic_w, exponent) of the power model.
POWER_PARAM_LOG_STD = (0.2, 0.5, 0.3)
# Extra relative error per doubling of distance from the nearest GPU count with data.
EXTRAPOLATION_REL_STD_PER_DOUBLING = 0.08

WORKLOAD_ALIASES = {
    "bert_base": "bert",
    "bert-base": "bert",
    "bert_base_uncased": "bert",
    "gpt-2": "gpt2",
    "resnet": "resnet50",
    "resnet-50": "resnet50",
    "resnet50_imagenet": "resnet50",
    "cifar10": "resnet50_cifar10",
    "vgg": "vgg16",
    "vgg-16": "vgg16",
    "inception": "inception3",
    "inception_v3": "inception3",
    "inceptionv3": "inception3",
    "deepspeech": "deepspeech2",
}


@dataclass(frozen=True)
class JobModelParams:
    """The parametric model behind a JobModel (what the fitter refines)."""

    workload: str
    global_batch_size: int
    throughput: ThroughputParams
    power: PowerParams
    gpu_max_w: float
    param_log_std: float
    prior_throughput_rel_std: float
    prior_power_rel_std: float


@dataclass(frozen=True)
class JobModel:
    """Throughput (samples/s) and total power (W) of one job at each allowed GPU count."""

    allowed_gpus: tuple[int, ...]
    throughput_samples_per_s: dict[int, float]
    power_w: dict[int, float]
    throughput_rel_std: dict[int, float]
    power_rel_std: dict[int, float]
    workload: str = GENERIC_WORKLOAD
    source: str = "prior"  # "prior" or "fitted"
    samples_used: int = 0
    # Samples with measured power the power model was fitted on (estimated ones never count).
    power_samples_used: int = 0
    params: JobModelParams | None = field(default=None, compare=False)
    # Layout last seen at each count and each layout's speed relative to the reference layout
    # (the most used one); the throughput table already includes these factors.
    layout_at: dict[int, str] = field(default_factory=dict)
    layout_speed_factor: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("throughput_samples_per_s", "power_w", "throughput_rel_std", "power_rel_std"):
            table: dict[int, float] = getattr(self, name)
            missing = [g for g in self.allowed_gpus if g not in table]
            if missing:
                raise ValueError(f"JobModel.{name} lacks GPU counts {missing}")

    def energy_per_sample_j(self, gpus: int) -> float:
        """Joules per training sample at `gpus` GPUs."""
        return self.power_w[gpus] / self.throughput_samples_per_s[gpus]

    def energy_per_sample_rel_std(self, gpus: int) -> float:
        """Relative std of energy per sample (throughput and power errors taken as independent)."""
        return math.hypot(self.throughput_rel_std[gpus], self.power_rel_std[gpus])

    def best_energy_gpus(self) -> int:
        """The allowed GPU count with the least energy per sample."""
        return min(self.allowed_gpus, key=self.energy_per_sample_j)


@dataclass(frozen=True)
class TelemetryPoint:
    """One telemetry sample of a running job."""

    gpus: int
    samples_per_s: float
    power_w: float | None  # total of the job's GPUs; None where not measured
    at: datetime
    layout: str | None = None  # e.g. "dp4" or "dp2-tp2"; each layout gets a fitted speed factor
    # Where power_w came from: "estimated" readings were computed from this very model (on
    # simulated slots), so fitting them would only confirm the model; they never train it.
    power_source: str = "measured"

    @property
    def power_measured(self) -> bool:
        """Whether power_w is a measurement the power model may learn from."""
        return self.power_w is not None and self.power_source not in ESTIMATED_POWER_SOURCES


def resolve_workload(workload: str) -> str:
    """The preset name for a workload string, or 'generic' for anything unknown."""
    key = workload.strip().lower()
    key = WORKLOAD_ALIASES.get(key, key)
    return key if key in THROUGHPUT_PRIORS else GENERIC_WORKLOAD


def known_presets() -> list[str]:
    """Workload presets with measured priors."""
    return sorted(THROUGHPUT_PRIORS)


def _generic_throughput() -> ThroughputParams:
    logs = [[math.log(v) for v in coeffs[:4]] for coeffs in THROUGHPUT_PRIORS.values()]
    mean = [sum(col) / len(col) for col in zip(*logs, strict=True)]
    return ThroughputParams(*(math.exp(v) for v in mean))


def prior_params(
    workload: str, global_batch_size: int, gpu: GpuPowerSpec = A100_POWER
) -> JobModelParams:
    """Prior model coefficients for a workload preset (or the generic fallback)."""
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    preset = resolve_workload(workload)
    if preset == GENERIC_WORKLOAD:
        throughput = _generic_throughput()
        busy_fraction = sum(BUSY_FRACTION.values()) / len(BUSY_FRACTION)
        t_std, p_log_std = GENERIC_THROUGHPUT_REL_STD, GENERIC_PARAM_LOG_STD
    else:
        a, d, b, c, rel_std = THROUGHPUT_PRIORS[preset]
        throughput = ThroughputParams(a, d, b, c)
        busy_fraction = BUSY_FRACTION.get(preset, gpu.busy_w / gpu.max_w)
        t_std, p_log_std = rel_std, PRESET_PARAM_LOG_STD
    return JobModelParams(
        workload=preset,
        global_batch_size=global_batch_size,
        throughput=throughput,
        power=gpu.params(busy_fraction * gpu.max_w),
        gpu_max_w=gpu.max_w,
        param_log_std=p_log_std,
        prior_throughput_rel_std=t_std,
        prior_power_rel_std=POWER_REL_STD,
    )


def model_from_params(
    params: JobModelParams,
    allowed_gpus: Sequence[int],
    throughput_rel_std: dict[int, float] | None = None,
    power_rel_std: dict[int, float] | None = None,
    source: str = "prior",
    samples_used: int = 0,
    layout_at: dict[int, str] | None = None,
    layout_speed_factor: dict[str, float] | None = None,
    power_samples_used: int = 0,
) -> JobModel:
    """Tabulate a parametric model at the allowed GPU counts (with each count's layout factor)."""
    counts = tuple(sorted(set(allowed_gpus)))
    if not counts or counts[0] <= 0:
        raise ValueError(f"allowed_gpus must be positive integers, got {list(allowed_gpus)}")
    batch = params.global_batch_size
    single = params.throughput.samples_per_s(1, batch)
    layout_at = layout_at or {}
    factors = layout_speed_factor or {}
    throughput = {
        g: params.throughput.samples_per_s(g, batch) * factors.get(layout_at.get(g, ""), 1.0)
        for g in counts
    }
    power = {g: g * params.power.per_gpu_w(throughput[g] / (g * single)) for g in counts}
    return JobModel(
        allowed_gpus=counts,
        throughput_samples_per_s=throughput,
        power_w=power,
        throughput_rel_std=throughput_rel_std
        or dict.fromkeys(counts, params.prior_throughput_rel_std),
        power_rel_std=power_rel_std or dict.fromkeys(counts, params.prior_power_rel_std),
        workload=params.workload,
        source=source,
        samples_used=samples_used,
        power_samples_used=power_samples_used,
        params=params,
        layout_at={g: layout_at[g] for g in counts if g in layout_at},
        layout_speed_factor=dict(factors),
    )


def prior_job_model(
    workload: str,
    global_batch_size: int,
    allowed_gpus: Sequence[int],
    gpu: GpuPowerSpec = A100_POWER,
) -> JobModel:
    """Cold-start JobModel from the committed per-preset priors (no data files needed)."""
    return model_from_params(prior_params(workload, global_batch_size, gpu), allowed_gpus)


class JobModelFitter:
    """Refits a job model online from telemetry; recent samples weigh more; prior yields to data."""

    def __init__(
        self,
        prior: JobModel,
        half_life_s: float = 1800.0,
        max_samples: int = 512,
        obs_rel_std: float = DEFAULT_OBS_REL_STD,
    ) -> None:
        if prior.params is None:
            raise ValueError("the prior JobModel carries no params; build it with prior_job_model")
        self.prior = prior
        self.half_life_s = half_life_s
        self.max_samples = max_samples
        self.obs_rel_std = obs_rel_std
        self.samples: list[TelemetryPoint] = []
        self.skipped = 0  # samples ignored because the job made no progress
        self.model = prior

    def update(self, samples: Iterable[TelemetryPoint]) -> JobModel:
        """Add telemetry samples and return the refitted model."""
        for point in samples:
            if point.gpus <= 0:
                raise ValueError(f"telemetry needs gpus > 0, got {point}")
            if point.at.tzinfo is None:
                raise ValueError(f"telemetry time must be timezone-aware UTC, got {point.at}")
            if not point.samples_per_s > 0:
                # A stalled interval (e.g. during a hot switch) says nothing about steady speed.
                self.skipped += 1
                continue
            self.samples.append(point)
        self.samples.sort(key=lambda p: p.at)
        del self.samples[: -self.max_samples]
        self.model = self._refit()
        return self.model

    def _weights(self) -> list[float]:
        latest = self.samples[-1].at if self.samples else datetime.now(UTC)
        return [0.5 ** ((latest - p.at).total_seconds() / self.half_life_s) for p in self.samples]

    def _refit(self) -> JobModel:
        prior = self.prior.params
        assert prior is not None
        if not self.samples:
            return self.prior
        weights = self._weights()
        batch = prior.global_batch_size
        # The most used layout (by weight) is the reference; others get a fitted speed factor.
        layout_weight: dict[str, float] = {}
        for p, w in zip(self.samples, weights, strict=True):
            key = p.layout or ""
            layout_weight[key] = layout_weight.get(key, 0.0) + w
        layouts = sorted(layout_weight, key=lambda k: (-layout_weight[k], k))
        index = {name: i for i, name in enumerate(layouts)}
        # The search starts from the last fit (a refit adds a few samples to hundreds).
        last = self.model.params if self.model.source == "fitted" else None
        last_speed = self.model.layout_speed_factor
        reference = math.log(last_speed.get(layouts[0], 1.0))
        throughput, log_factors = fit_throughput_layouts(
            [
                ThroughputObs(p.gpus, batch, p.samples_per_s, w, index[p.layout or ""])
                for p, w in zip(self.samples, weights, strict=True)
            ],
            prior.throughput,
            len(layouts),
            prior_log_std=prior.param_log_std,
            obs_rel_std=self.obs_rel_std,
            start=None
            if last is None
            else (
                last.throughput,
                [math.log(last_speed.get(name, 1.0)) - reference for name in layouts],
            ),
        )
        speed = {name: math.exp(log_factors[i]) for name, i in index.items()}
        layout_at = {p.gpus: p.layout or "" for p in self.samples}  # latest sample wins
        single = throughput.samples_per_s(1, batch)
        powered = [(p, w) for p, w in zip(self.samples, weights, strict=True) if p.power_measured]
        power = fit_power(
            [
                PowerObs(p.samples_per_s / (p.gpus * single), p.power_w / p.gpus, w)
                for p, w in powered
                if p.power_w is not None
            ],
            prior.power,
            prior_log_std=POWER_PARAM_LOG_STD,
            obs_rel_std=self.obs_rel_std,
            start=None if last is None else last.power,
        )
        params = replace(prior, throughput=throughput, power=power)
        counts = self.prior.allowed_gpus
        t_std = self._rel_std(
            counts,
            [
                (
                    p.gpus,
                    w,
                    math.log(
                        p.samples_per_s
                        / (throughput.samples_per_s(p.gpus, batch) * speed[p.layout or ""])
                    ),
                )
                for p, w in zip(self.samples, weights, strict=True)
            ],
            prior.prior_throughput_rel_std,
        )
        p_std = self._rel_std(
            counts,
            [
                (
                    p.gpus,
                    w,
                    math.log(
                        p.power_w / (p.gpus * power.per_gpu_w(p.samples_per_s / (p.gpus * single)))
                    ),
                )
                for p, w in powered
                if p.power_w is not None
            ],
            prior.prior_power_rel_std,
        )
        return model_from_params(
            params,
            counts,
            t_std,
            p_std,
            source="fitted",
            samples_used=len(self.samples),
            power_samples_used=len(powered),
            layout_at=layout_at,
            layout_speed_factor=speed,
        )

    def _rel_std(
        self,
        counts: Sequence[int],
        residuals: list[tuple[int, float, float]],
        prior_rel_std: float,
    ) -> dict[int, float]:
        """Per-count relative std: prior combined with the (weighted) evidence at that count."""
        if not residuals:
            return dict.fromkeys(counts, prior_rel_std)
        total_w = sum(w for _, w, _ in residuals)
        resid_var = sum(w * r * r for _, w, r in residuals) / max(total_w, 1e-12)
        obs_var = max(resid_var, self.obs_rel_std**2)
        weight_at: dict[int, float] = {}
        for g, w, _ in residuals:
            weight_at[g] = weight_at.get(g, 0.0) + w
        out: dict[int, float] = {}
        for g in counts:
            if g in weight_at:
                post_var = 1.0 / (1.0 / prior_rel_std**2 + weight_at[g] / obs_var)
                out[g] = math.sqrt(post_var + resid_var)
            else:
                # Interpolating between measured counts is safer than extrapolating far away.
                doublings = min(abs(math.log2(g) - math.log2(m)) for m in weight_at)
                extra = EXTRAPOLATION_REL_STD_PER_DOUBLING * doublings
                out[g] = min(math.sqrt(obs_var + extra**2), max(prior_rel_std, math.sqrt(obs_var)))
        return out
