"""Torch fits of the throughput and power models (MAP estimates with a Gaussian prior in log space).

Throughput (time of one iteration of global batch `B` on `n` GPUs, data parallel):

    t_iter(n, B) = compute_s_per_sample * B / n        # compute, split over GPUs
                 + overhead_s                          # per-iteration fixed cost
                 + allreduce_s * (n - 1) / n            # ring all-reduce bandwidth term
                 + latency_s * log2(n)                  # all-reduce latency term
    samples_per_s(n, B) = B / t_iter(n, B)

Every coefficient is positive, so throughput grows with diminishing returns (and can fall again
at large `n` when communication dominates, as the measured profiles do). Telemetry from other
parallel layouts (tensor/pipeline) multiplies this curve by a fitted per-layout speed factor.

Per-GPU power, with utilisation `u` = per-GPU samples/s over what one GPU alone achieves:

    power_per_gpu_w(u) = idle_w + dynamic_w * u ** exponent

so a badly scaling GPU count keeps paying idle power for every GPU while doing little work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Each fit imports torch itself: loading it takes a second or more, and the scheduler's API
    # (which imports the model types, not the fits) must start without it.
    import torch

# Relative noise assumed for one telemetry sample (log-space std); sets how fast data beats prior.
DEFAULT_OBS_REL_STD = 0.05
# Prior log-std of a layout's speed relative to the reference layout at the same GPU count.
LAYOUT_LOG_STD = 0.3


@dataclass(frozen=True)
class ThroughputParams:
    """Coefficients of the iteration-time model (seconds)."""

    compute_s_per_sample: float
    overhead_s: float
    allreduce_s: float
    latency_s: float

    def iteration_s(self, gpus: int, global_batch_size: int) -> float:
        """Predicted seconds per iteration of `global_batch_size` samples on `gpus` GPUs."""
        n = float(gpus)
        return (
            self.compute_s_per_sample * global_batch_size / n
            + self.overhead_s
            + self.allreduce_s * (n - 1.0) / n
            + self.latency_s * math.log2(n)
        )

    def samples_per_s(self, gpus: int, global_batch_size: int) -> float:
        """Predicted samples/s of the whole job."""
        return global_batch_size / self.iteration_s(gpus, global_batch_size)

    def as_log_tensor(self) -> torch.Tensor:
        """Log of the four coefficients (the space the fit works in)."""
        import torch

        values = [self.compute_s_per_sample, self.overhead_s, self.allreduce_s, self.latency_s]
        return torch.tensor([math.log(max(v, 1e-12)) for v in values], dtype=torch.float64)

    @staticmethod
    def from_log_tensor(theta: torch.Tensor) -> ThroughputParams:
        """Inverse of `as_log_tensor`."""
        import torch

        a, d, b, c = (float(x) for x in torch.exp(theta).tolist())
        return ThroughputParams(a, d, b, c)


@dataclass(frozen=True)
class PowerParams:
    """Per-GPU power model: idle_w + dynamic_w * utilisation ** exponent."""

    idle_w: float
    dynamic_w: float
    exponent: float

    def per_gpu_w(self, utilisation: float) -> float:
        """Average power (W) of one GPU at the given utilisation (0..1, may exceed 1 slightly)."""
        u = min(max(utilisation, 0.0), 1.5)
        return self.idle_w + self.dynamic_w * u**self.exponent

    def as_log_tensor(self) -> torch.Tensor:
        """Log of the three coefficients."""
        import torch

        values = [self.idle_w, self.dynamic_w, self.exponent]
        return torch.tensor([math.log(max(v, 1e-9)) for v in values], dtype=torch.float64)

    @staticmethod
    def from_log_tensor(theta: torch.Tensor) -> PowerParams:
        """Inverse of `as_log_tensor`."""
        import torch

        idle, dyn, exp = (float(x) for x in torch.exp(theta).tolist())
        return PowerParams(idle, dyn, exp)


@dataclass(frozen=True)
class ThroughputObs:
    """One throughput observation for fitting."""

    gpus: int
    global_batch_size: int
    samples_per_s: float
    weight: float = 1.0
    layout_index: int = 0  # 0 = the reference layout; others get their own speed factor


@dataclass(frozen=True)
class PowerObs:
    """One per-GPU power observation at a utilisation."""

    utilisation: float
    per_gpu_power_w: float
    weight: float = 1.0


def _minimise(theta0: torch.Tensor, loss_fn: object, max_iter: int = 200) -> torch.Tensor:
    import torch

    theta = theta0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [theta],
        lr=1.0,
        max_iter=max_iter,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-10,
        tolerance_change=1e-12,
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn(theta)  # type: ignore[operator]
        loss.backward()
        return loss

    opt.step(closure)
    return theta.detach()


def fit_throughput(
    observations: Sequence[ThroughputObs],
    prior: ThroughputParams,
    prior_log_std: float | Sequence[float] = 1.0,
    obs_rel_std: float = DEFAULT_OBS_REL_STD,
) -> ThroughputParams:
    """MAP fit of the iteration-time model to observed samples/s (log-space errors)."""
    return fit_throughput_layouts(observations, prior, 1, prior_log_std, obs_rel_std)[0]


def fit_throughput_layouts(
    observations: Sequence[ThroughputObs],
    prior: ThroughputParams,
    n_layouts: int,
    prior_log_std: float | Sequence[float] = 1.0,
    obs_rel_std: float = DEFAULT_OBS_REL_STD,
    layout_log_std: float = LAYOUT_LOG_STD,
) -> tuple[ThroughputParams, tuple[float, ...]]:
    """As fit_throughput, plus one log speed factor per non-reference layout (index 1..n-1)."""
    import torch

    if not observations:
        return prior, (0.0,) * n_layouts
    theta0 = torch.cat([prior.as_log_tensor(), torch.zeros(n_layouts - 1, dtype=torch.float64)])
    n = torch.tensor([float(o.gpus) for o in observations], dtype=torch.float64)
    batch = torch.tensor([float(o.global_batch_size) for o in observations], dtype=torch.float64)
    log_obs = torch.log(torch.tensor([o.samples_per_s for o in observations], dtype=torch.float64))
    w = torch.tensor([o.weight for o in observations], dtype=torch.float64)
    layout = torch.tensor([o.layout_index for o in observations], dtype=torch.long)
    if int(layout.max()) >= n_layouts or int(layout.min()) < 0:
        raise ValueError(f"layout_index must be in 0..{n_layouts - 1}")
    prior_std = torch.cat(
        [
            torch.as_tensor(prior_log_std, dtype=torch.float64).expand(4),
            torch.full((n_layouts - 1,), layout_log_std, dtype=torch.float64),
        ]
    )

    def loss(theta: torch.Tensor) -> torch.Tensor:
        a, d, b, c = torch.exp(theta[:4])
        factors = torch.cat([torch.zeros(1, dtype=torch.float64), theta[4:]])
        t_iter = a * batch / n + d + b * (n - 1.0) / n + c * torch.log2(n)
        pred = torch.log(batch / t_iter) + factors[layout]
        resid = (pred - log_obs) / obs_rel_std
        penalty = ((theta - theta0) / prior_std) ** 2
        return 0.5 * (w * resid**2).sum() + 0.5 * penalty.sum()

    theta = _minimise(theta0, loss)
    factors = (0.0, *(float(x) for x in theta[4:].tolist()))
    return ThroughputParams.from_log_tensor(theta[:4]), factors


def fit_power(
    observations: Sequence[PowerObs],
    prior: PowerParams,
    prior_log_std: float | Sequence[float] = 0.5,
    obs_rel_std: float = DEFAULT_OBS_REL_STD,
) -> PowerParams:
    """MAP fit of the per-GPU power model to observed (utilisation, W) pairs."""
    import torch

    if not observations:
        return prior
    theta0 = prior.as_log_tensor()
    u = torch.tensor(
        [min(max(o.utilisation, 1e-6), 1.5) for o in observations], dtype=torch.float64
    )
    log_obs = torch.log(
        torch.tensor([o.per_gpu_power_w for o in observations], dtype=torch.float64)
    )
    w = torch.tensor([o.weight for o in observations], dtype=torch.float64)
    prior_std = torch.as_tensor(prior_log_std, dtype=torch.float64).expand(3)

    def loss(theta: torch.Tensor) -> torch.Tensor:
        idle, dyn, exp = torch.exp(theta)
        pred = idle + dyn * u**exp
        resid = (torch.log(pred) - log_obs) / obs_rel_std
        penalty = ((theta - theta0) / prior_std) ** 2
        return 0.5 * (w * resid**2).sum() + 0.5 * penalty.sum()

    return PowerParams.from_log_tensor(_minimise(theta0, loss))
