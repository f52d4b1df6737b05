"""Hourly intensity forecasters for sources without a forecast, and to fill gaps.

- `seasonal_naive`: the value one period earlier (24 h: same hour yesterday; 168 h: last week).
- `HourlyRidgeForecaster`: one linear model per horizon hour h, in log space, on features known
  at the forecast origin t: the latest three values y[t], y[t-1], y[t-2] and the value 24 h ago
  y[t-24] (today's departure from yesterday); the target hour on the latest day y[t+h-24k]
  (fewest whole days k with t+h-24k <= t), its neighbouring hours where they are known, and the
  day before; the target hour last week; the mean of the target hour over the last 7 days; the
  mean of the last 6 h, of the same 6 h yesterday, of the last 24 h and of the last week.
  Fitted by ridge, then a few reweighted least-squares steps towards least absolute error
  (the median in log space: what a percentage error rewards). Refitted on the most recent
  12 weeks of history.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np

from energy_model.carbon.series import IntensitySeries

HOUR_S = 3600
WEEK_H = 168
# Days of history the ridge model needs: a week of lags plus room to fit.
MIN_FIT_HISTORY_H = WEEK_H + 24 * 7
# The model is refitted on the most recent 12 weeks: grids change with the season.
FIT_WINDOW_H = WEEK_H * 12


def to_hourly(series: IntensitySeries) -> tuple[datetime, np.ndarray]:
    """Resample a step series onto whole UTC hours (value holding at each hour; gaps held)."""
    start = series.times[0].astimezone(UTC)
    start = start.replace(minute=0, second=0, microsecond=0)
    if start < series.times[0]:
        start += timedelta(hours=1)
    end = series.times[-1].astimezone(UTC)
    n = int((end - start).total_seconds() // HOUR_S) + 1
    if n <= 0:
        return series.times[0], np.asarray([series.intensity_g_per_kwh[0]], dtype=float)
    t_s = np.asarray([t.timestamp() for t in series.times])
    v = np.asarray(series.intensity_g_per_kwh, dtype=float)
    grid = start.timestamp() + HOUR_S * np.arange(n)
    idx = np.searchsorted(t_s, grid, side="right") - 1
    return start, v[np.clip(idx, 0, len(v) - 1)]


def seasonal_naive(history: np.ndarray, horizon_h: int, period_h: int = 24) -> np.ndarray:
    """Forecast y[t+h] = y[t+h-period*k] for h = 1..horizon_h, k the fewest periods back."""
    if len(history) == 0:
        raise ValueError("seasonal_naive needs at least one past value")
    t = len(history) - 1
    out = np.empty(horizon_h)
    for h in range(1, horizon_h + 1):
        back = period_h * math.ceil(h / period_h)
        j = t + h - back
        out[h - 1] = history[j] if j >= 0 else history[t]
    return out


def _trailing_mean(y: np.ndarray, ends: np.ndarray, width: int) -> np.ndarray:
    """Mean of y[end - width + 1 .. end] for each end (a cumulative sum: no loop over width)."""
    total = np.concatenate([[0.0], np.cumsum(y)])
    return (total[ends + 1] - total[ends + 1 - width]) / width


def _features(y: np.ndarray, origins: np.ndarray, h: int) -> np.ndarray:
    """Design matrix rows for forecasting y[t+h] from origins t (all lags already in range)."""
    day_back = 24 * math.ceil(h / 24)
    week_back = WEEK_H * math.ceil(h / WEEK_H)
    target_yesterday = origins + h - day_back  # <= origins by the choice of day_back
    # The hour after the target yesterday is known only while it is not after the origin.
    after = target_yesterday + 1 if h - day_back + 1 <= 0 else origins
    return np.column_stack(
        [
            np.ones(len(origins)),
            y[origins],  # latest value
            y[origins - 1],  # the hour before (local trend)
            y[origins - 2],
            y[origins - 24],  # now yesterday: today's departure from yesterday
            y[target_yesterday],  # same hour, latest day
            y[target_yesterday - 1],  # its neighbours (a shifted peak)
            y[after],
            y[target_yesterday - 24],  # same hour, the day before
            y[origins + h - week_back],  # same hour last week
            np.mean([y[target_yesterday - 24 * k] for k in range(7)], axis=0),
            _trailing_mean(y, origins, 6),  # level of the last 6 h
            _trailing_mean(y, origins - 24, 6),  # the same 6 h yesterday
            _trailing_mean(y, origins, 24),  # level of the last day
            _trailing_mean(y, origins, WEEK_H),  # level of the last week
        ]
    )


def _first_origin(h: int) -> int:
    # Earliest origin with every lag of horizon h inside the history.
    day_back = 24 * math.ceil(h / 24)
    week_back = WEEK_H * math.ceil(h / WEEK_H)
    return max(day_back + 24 * 6 - h + 1, week_back - h, WEEK_H)


@dataclass
class HourlyRidgeForecaster:
    """Per-horizon linear model on daily/weekly lags in log space (ridge, then towards L1)."""

    horizon_h: int = 48
    ridge: float = 1.0
    # Reweighted least-squares steps from the ridge fit towards least absolute error (0: ridge).
    l1_steps: int = 3
    coef: np.ndarray | None = None  # (horizon_h, n_features)

    def fit(self, history: np.ndarray) -> HourlyRidgeForecaster:
        """Fit on an hourly history; needs at least MIN_FIT_HISTORY_H hours."""
        y = np.log(np.maximum(np.asarray(history, dtype=float), 1.0))
        if len(y) < MIN_FIT_HISTORY_H:
            raise ValueError(
                f"ridge forecaster needs >= {MIN_FIT_HISTORY_H} h of history, got {len(y)}"
            )
        coefs = []
        for h in range(1, self.horizon_h + 1):
            origins = np.arange(_first_origin(h), len(y) - h)
            if len(origins) < 24:
                raise ValueError(f"too little history to fit horizon {h} h")
            x = _features(y, origins, h)
            target = y[origins + h]
            penalty = self.ridge * np.eye(x.shape[1])
            penalty[0, 0] = 0.0  # the intercept is not shrunk
            coef = np.linalg.solve(x.T @ x + penalty, x.T @ target)
            for _ in range(self.l1_steps):
                # Weights 1/|residual| turn squared error into absolute error (floored so a
                # perfectly fitted hour cannot take all the weight).
                weight = 1.0 / np.maximum(np.abs(target - x @ coef), 1e-3)
                xw = x * weight[:, None]
                coef = np.linalg.solve(xw.T @ x + penalty, xw.T @ target)
            coefs.append(coef)
        self.coef = np.asarray(coefs)
        return self

    def predict(self, history: np.ndarray) -> np.ndarray:
        """Forecast the next horizon_h hours after the last value of `history`."""
        if self.coef is None:
            raise RuntimeError("fit the forecaster before predicting")
        y = np.log(np.maximum(np.asarray(history, dtype=float), 1.0))
        t = len(y) - 1
        if t < _first_origin(self.horizon_h):
            return seasonal_naive(np.asarray(history, dtype=float), self.horizon_h)
        out = np.empty(self.horizon_h)
        for h in range(1, self.horizon_h + 1):
            x = _features(y, np.asarray([t]), h)
            out[h - 1] = float(np.exp(x @ self.coef[h - 1])[0])
        return out

    def predict_many(self, y_raw: np.ndarray, origins: np.ndarray) -> np.ndarray:
        """Forecasts (len(origins), horizon_h) from many origins of one series (for benchmarks)."""
        if self.coef is None:
            raise RuntimeError("fit the forecaster before predicting")
        y = np.log(np.maximum(np.asarray(y_raw, dtype=float), 1.0))
        out = np.empty((len(origins), self.horizon_h))
        for h in range(1, self.horizon_h + 1):
            out[:, h - 1] = np.exp(_features(y, origins, h) @ self.coef[h - 1])
        return out


def forecast_hourly(
    history: Sequence[float] | np.ndarray, horizon_h: int, ridge: float = 1.0
) -> tuple[np.ndarray, str]:
    """Best available forecast of the next `horizon_h` hours and the method used."""
    y = np.asarray(history, dtype=float)
    if len(y) >= MIN_FIT_HISTORY_H + horizon_h + 24:
        recent = y[-FIT_WINDOW_H:]
        model = HourlyRidgeForecaster(horizon_h=horizon_h, ridge=ridge).fit(recent)
        return model.predict(recent), "ridge"
    if len(y) >= 24:
        return seasonal_naive(y, horizon_h, 24), "seasonal_naive_24h"
    if len(y) >= 1:
        return np.full(horizon_h, y[-1]), "persistence"
    raise ValueError("cannot forecast from an empty history")
