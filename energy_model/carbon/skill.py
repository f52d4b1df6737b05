"""Measured forecast skill per horizon hour: the provider/local blend and the upper quantile.

Every forecast a source issues is kept on a whole-hour grid: issued in hour o, its value for hour
o + h is the mean of its step function over that hour (h = 1, 2, ...). Once hour o + h has been
observed, it gives a log error e = ln(actual / forecast) at horizon h. Per method (the
provider's own forecast, our local forecaster, and the final forecast handed to the planner)
the errors of the origins in the last `window_h` hours are scored:

- blend: at each horizon hour where both the provider and the local forecaster have at least
  `min_samples` scored errors, the two are combined in log space with weights inversely
  proportional to their mean squared log error (bias included); elsewhere the provider's own
  forecast stands, and our forecaster only fills what the provider does not cover;
- upper quantile: the `quantile` of the final forecast's log errors at each horizon hour,
  floored at 1x (the planner never plans a cleaner grid than forecast); with too few scored
  errors, the prior below.

The prior is the 80th percentile of ln(actual / forecast) of our forecaster on the eight real
series of `bench/forecast_error.py` (rolling origin, out of sample; printed by that bench as
`upper_log_error_q80`), per horizon hour 1..24; later hours hold the 24 h value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from statistics import NormalDist

import numpy as np

from energy_model.emissions import StepSeries, split_by_steps

HOUR = timedelta(hours=1)
PRIOR_QUANTILE = 0.8
# 80th percentile of ln(actual / forecast) per horizon hour 1..24 (bench/forecast_error.py,
# 2026-11-27, pooled over the eight series).
PRIOR_UPPER_LOG_ERROR_Q80: tuple[float, ...] = (
    0.0207,
    0.0359,
    0.0479,
    0.0559,
    0.0626,
    0.0677,
    0.0717,
    0.075,
    0.0777,
    0.0802,
    0.0823,
    0.0839,
    0.0862,
    0.0874,
    0.0892,
    0.0904,
    0.0917,
    0.0928,
    0.0937,
    0.0949,
    0.0959,
    0.0968,
    0.0977,
    0.0988,
)

METHODS = ("provider", "local", "final")


def floor_hour(at: datetime) -> datetime:
    """The whole UTC hour holding `at`."""
    return at.replace(minute=0, second=0, microsecond=0)


def hourly_means(
    series: StepSeries, origin_hour: datetime, end_at: datetime, max_hours: int
) -> np.ndarray:
    """Mean of a step series over hours origin+1h, origin+2h, ... that end by `end_at`."""
    out: list[float] = []
    first = series.times[0]
    for h in range(1, max_hours + 1):
        lo = origin_hour + h * HOUR
        hi = lo + HOUR
        if hi > end_at or lo < first:
            break
        parts = split_by_steps(lo, hi, series)
        out.append(sum(s * v for s, v in parts) / sum(s for s, _ in parts))
    return np.asarray(out, dtype=float)


def prior_upper_factor(horizon_h: int, quantile: float = PRIOR_QUANTILE) -> float:
    """Upper-quantile factor at a horizon hour before anything is measured (the bench's prior)."""
    index = min(max(horizon_h, 1), len(PRIOR_UPPER_LOG_ERROR_Q80)) - 1
    log_q80 = PRIOR_UPPER_LOG_ERROR_Q80[index]
    if math.isclose(quantile, PRIOR_QUANTILE):
        return math.exp(log_q80)
    # Other quantiles: scale as a normal spread with the same 80th percentile.
    normal = NormalDist()
    return math.exp(max(0.0, log_q80 / normal.inv_cdf(PRIOR_QUANTILE) * normal.inv_cdf(quantile)))


@dataclass(frozen=True)
class HorizonSkill:
    """Measured skill at one horizon hour."""

    horizon_h: int
    provider_samples: int
    local_samples: int
    final_samples: int
    provider_mape: float | None  # %, None with no scored error
    local_mape: float | None
    final_mape: float | None
    provider_weight: float  # share of the provider's forecast in the blend (log space)
    upper_factor: float  # the planner's intensity / the forecast at this horizon
    upper_measured: bool  # False: the prior


class ForecastSkill:
    """Issued forecasts per method and hour, scored against the hours observed since."""

    def __init__(
        self,
        *,
        horizon_h: int = 72,
        window_h: int = 14 * 24,
        min_samples: int = 24,
        quantile: float = PRIOR_QUANTILE,
    ) -> None:
        if not 0.5 <= quantile < 1.0:
            raise ValueError(f"quantile must be in [0.5, 1), got {quantile}")
        self.horizon_h = horizon_h
        self.window_h = window_h
        self.min_samples = min_samples
        self.quantile = quantile
        # method -> origin hour -> forecast values for origin+1h .. origin+len h.
        self.issued: dict[str, dict[datetime, np.ndarray]] = {m: {} for m in METHODS}

    def issue(
        self, method: str, origin_hour: datetime, values: Sequence[float] | np.ndarray
    ) -> None:
        """Keep one forecast of `method` per origin hour: the first that reaches furthest."""
        if method not in self.issued:
            raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")
        book = self.issued[method]
        known = book.get(origin_hour)
        if len(values) == 0 or (known is not None and len(known) >= len(values)):
            return
        book[origin_hour] = np.asarray(values[: self.horizon_h], dtype=float)
        cutoff = origin_hour - timedelta(hours=self.window_h + self.horizon_h)
        for old in [o for o in book if o < cutoff]:
            del book[old]

    def log_errors(self, method: str, actual: Mapping[datetime, float]) -> list[np.ndarray]:
        """Per horizon hour (index h-1), the scored ln(actual / forecast) of `method`."""
        per_h: list[list[float]] = [[] for _ in range(self.horizon_h)]
        if not actual:
            return [np.zeros(0) for _ in per_h]
        newest = max(actual)
        since = newest - timedelta(hours=self.window_h)
        for origin, values in self.issued[method].items():
            if origin < since:
                continue
            for h, predicted in enumerate(values, start=1):
                seen = actual.get(origin + h * HOUR)
                if seen is None or seen <= 0 or predicted <= 0:
                    continue
                per_h[h - 1].append(math.log(seen / predicted))
        return [np.asarray(v, dtype=float) for v in per_h]

    def provider_weights(self, actual: Mapping[datetime, float]) -> np.ndarray:
        """Per horizon hour, the provider's share of the blend (1 where skill is not yet known)."""
        provider = self.log_errors("provider", actual)
        local = self.log_errors("local", actual)
        weights = np.ones(self.horizon_h)
        for i, (p, q) in enumerate(zip(provider, local, strict=True)):
            if len(p) < self.min_samples or len(q) < self.min_samples:
                continue
            mse_p = float(np.mean(p**2)) + 1e-9
            mse_q = float(np.mean(q**2)) + 1e-9
            weights[i] = (1 / mse_p) / (1 / mse_p + 1 / mse_q)
        return weights

    def upper_factors(self, actual: Mapping[datetime, float]) -> tuple[np.ndarray, np.ndarray]:
        """Per horizon hour, (planner factor >= 1 on the forecast, measured or prior)."""
        final = self.log_errors("final", actual)
        factors = np.empty(self.horizon_h)
        measured = np.zeros(self.horizon_h, dtype=bool)
        for i, errors in enumerate(final):
            if len(errors) >= self.min_samples:
                factors[i] = max(1.0, math.exp(float(np.quantile(errors, self.quantile))))
                measured[i] = True
            else:
                factors[i] = prior_upper_factor(i + 1, self.quantile)
        return factors, measured

    def report(self, actual: Mapping[datetime, float]) -> list[HorizonSkill]:
        """The skill per horizon hour, as the service shows it."""
        errors = {m: self.log_errors(m, actual) for m in METHODS}
        weights = self.provider_weights(actual)
        factors, measured = self.upper_factors(actual)

        def mape(values: np.ndarray) -> float | None:
            # |actual - forecast| / actual = |1 - exp(-e)|.
            return None if len(values) == 0 else 100 * float(np.mean(np.abs(1 - np.exp(-values))))

        return [
            HorizonSkill(
                horizon_h=i + 1,
                provider_samples=len(errors["provider"][i]),
                local_samples=len(errors["local"][i]),
                final_samples=len(errors["final"][i]),
                provider_mape=mape(errors["provider"][i]),
                local_mape=mape(errors["local"][i]),
                final_mape=mape(errors["final"][i]),
                provider_weight=float(weights[i]),
                upper_factor=float(factors[i]),
                upper_measured=bool(measured[i]),
            )
            for i in range(self.horizon_h)
        ]
