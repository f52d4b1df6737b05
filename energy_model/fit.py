"""Fits of the throughput and power models (MAP estimates with a Gaussian prior in log space).

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

Both fits minimise a smooth loss of 3-7 parameters with BFGS (scipy) on analytic gradients:
the control loop refits up to dozens of jobs a tick, and torch's autograd L-BFGS spent about
38 ms a refit on such a problem where this takes a few (and the scheduler needs no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

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

    def as_log_array(self) -> np.ndarray:
        """Log of the four coefficients (the space the fit works in)."""
        values = [self.compute_s_per_sample, self.overhead_s, self.allreduce_s, self.latency_s]
        return np.log(np.maximum(np.asarray(values, dtype=float), 1e-12))

    @staticmethod
    def from_log_array(theta: np.ndarray) -> ThroughputParams:
        """Inverse of `as_log_array`."""
        a, d, b, c = (float(x) for x in np.exp(theta))
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

    def as_log_array(self) -> np.ndarray:
        """Log of the three coefficients."""
        values = [self.idle_w, self.dynamic_w, self.exponent]
        return np.log(np.maximum(np.asarray(values, dtype=float), 1e-9))

    @staticmethod
    def from_log_array(theta: np.ndarray) -> PowerParams:
        """Inverse of `as_log_array`."""
        idle, dyn, exp = (float(x) for x in np.exp(theta))
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


# A loss and its gradient at theta.
LossAndGrad = Callable[[np.ndarray], tuple[float, np.ndarray]]


def _finite(loss_and_grad: LossAndGrad) -> LossAndGrad:
    """The loss as +inf where it overflows: the line search's long trial steps then back off
    instead of warning or reading NaN."""

    def guarded(theta: np.ndarray) -> tuple[float, np.ndarray]:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            loss, grad = loss_and_grad(theta)
        if not (math.isfinite(loss) and np.isfinite(grad).all()):
            return math.inf, np.zeros_like(theta)
        return loss, grad

    return guarded


def _minimise(theta0: np.ndarray, loss_and_grad: LossAndGrad, max_iter: int = 200) -> np.ndarray:
    """The loss's minimum from `theta0` (BFGS: on 4-7 parameters scipy's L-BFGS-B spent about a
    millisecond per iteration inside its routine here, 2-17 ms a fit against BFGS's 3)."""
    from scipy.optimize import minimize  # imported by the first fit, not by the API at start

    result = minimize(
        loss_and_grad,
        theta0,
        jac=True,
        method="BFGS",
        options={"maxiter": max_iter, "gtol": 1e-9},
    )
    return np.asarray(result.x, dtype=float)


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
    start: tuple[ThroughputParams, Sequence[float]] | None = None,
) -> tuple[ThroughputParams, tuple[float, ...]]:
    """As fit_throughput, plus one log speed factor per non-reference layout (index 1..n-1).

    `start`: where the search begins (an earlier fit's parameters and log factors, one per
    layout): the same optimum, reached in fewer steps when a refit adds a few samples."""
    if not observations:
        return prior, (0.0,) * n_layouts
    theta0 = np.concatenate([prior.as_log_array(), np.zeros(n_layouts - 1)])
    n = np.array([float(o.gpus) for o in observations])
    batch = np.array([float(o.global_batch_size) for o in observations])
    log_obs = np.log(np.array([o.samples_per_s for o in observations]))
    w = np.array([o.weight for o in observations])
    layout = np.array([o.layout_index for o in observations], dtype=int)
    if int(layout.max()) >= n_layouts or int(layout.min()) < 0:
        raise ValueError(f"layout_index must be in 0..{n_layouts - 1}")
    prior_std = np.concatenate(
        [
            np.broadcast_to(np.asarray(prior_log_std, dtype=float), (4,)),
            np.full(n_layouts - 1, layout_log_std),
        ]
    )
    # d t_iter / d log(coefficient) = coefficient x these terms (one row per coefficient).
    terms = np.stack([batch / n, np.ones_like(n), (n - 1.0) / n, np.log2(n)])
    # Which layout factor each observation uses (the reference layout has none).
    uses = (layout[None, :] == np.arange(1, n_layouts)[:, None]).astype(float)

    @_finite
    def loss_and_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
        coefficients = np.exp(theta[:4])
        parts = coefficients[:, None] * terms
        t_iter = parts.sum(axis=0)
        factors = np.concatenate([[0.0], theta[4:]])
        pred = np.log(batch / t_iter) + factors[layout]
        resid = (pred - log_obs) / obs_rel_std
        gap = (theta - theta0) / prior_std
        loss = 0.5 * float((w * resid**2).sum()) + 0.5 * float((gap**2).sum())
        pull = w * resid / obs_rel_std  # d loss / d pred, per observation
        grad = gap / prior_std
        grad[:4] += -(parts / t_iter) @ pull
        grad[4:] += uses @ pull
        return loss, grad

    begin = theta0
    if start is not None and len(start[1]) == n_layouts:
        begin = np.concatenate([start[0].as_log_array(), np.asarray(start[1][1:], dtype=float)])
    theta = _minimise(begin, loss_and_grad)
    factors = (0.0, *(float(x) for x in theta[4:]))
    return ThroughputParams.from_log_array(theta[:4]), factors


def fit_power(
    observations: Sequence[PowerObs],
    prior: PowerParams,
    prior_log_std: float | Sequence[float] = 0.5,
    obs_rel_std: float = DEFAULT_OBS_REL_STD,
    start: PowerParams | None = None,
) -> PowerParams:
    """MAP fit of the per-GPU power model to observed (utilisation, W) pairs (`start`: where
    the search begins, as in fit_throughput_layouts)."""
    if not observations:
        return prior
    theta0 = prior.as_log_array()
    u = np.array([min(max(o.utilisation, 1e-6), 1.5) for o in observations])
    log_u = np.log(u)
    log_obs = np.log(np.array([o.per_gpu_power_w for o in observations]))
    w = np.array([o.weight for o in observations])
    prior_std = np.broadcast_to(np.asarray(prior_log_std, dtype=float), (3,))

    @_finite
    def loss_and_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
        idle, dyn, exponent = np.exp(theta)
        dynamic = dyn * u**exponent
        pred = idle + dynamic
        resid = (np.log(pred) - log_obs) / obs_rel_std
        gap = (theta - theta0) / prior_std
        loss = 0.5 * float((w * resid**2).sum()) + 0.5 * float((gap**2).sum())
        pull = w * resid / obs_rel_std / pred  # d loss / d pred, per observation
        grad = gap / prior_std
        grad += np.array([pull.sum() * idle, pull @ dynamic, pull @ (dynamic * log_u * exponent)])
        return loss, grad

    begin = theta0 if start is None else start.as_log_array()
    return PowerParams.from_log_array(_minimise(begin, loss_and_grad))
