"""24 h carbon-intensity forecast error of our forecaster vs seasonal-naive baselines.

Rolling origin on each real series in ../shared/data/carbon: every hour is a forecast origin;
the model is refitted every week on the previous 12 weeks (the library refits on the latest 12
weeks at every call) and never sees the values it forecasts. Also the spread the planner's
upper quantile rests on: per horizon hour the 80th percentile of ln(actual / forecast), pooled
over the series (the prior of energy_model.carbon.skill), and how often the actual value
exceeded the forecast times the factor measured, as the service measures it, on the previous
two weeks of scored forecasts (target 20 %). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from energy_model.carbon.forecaster import (
    FIT_WINDOW_H,
    WEEK_H,
    HourlyRidgeForecaster,
    to_hourly,
)
from energy_model.carbon.series import load_intensity_csv

HORIZON_H = 24
REFIT_EVERY_H = WEEK_H


def naive_many(y: np.ndarray, origins: np.ndarray, period_h: int) -> np.ndarray:
    """Seasonal-naive forecasts (len(origins), HORIZON_H) with the given period."""
    h = np.arange(1, HORIZON_H + 1)
    back = period_h * np.ceil(h / period_h).astype(int)
    return y[origins[:, None] + h[None, :] - back[None, :]]


QUANTILE = 0.8
SKILL_WINDOW_H = 14 * 24  # energy_model.carbon.skill.ForecastSkill's default window


def evaluate(y: np.ndarray) -> dict[str, np.ndarray]:
    """Absolute percentage errors (origins, horizon) of each method on one hourly series.

    Also `log_model`: the model's ln(actual / forecast), and `above_upper`: whether the actual
    exceeded the forecast times the QUANTILE of the log errors scored in the previous two weeks
    (origins whose hours had all been observed), floored at 1x (NaN before two weeks are scored).
    """
    errors: dict[str, list[np.ndarray]] = {"naive": [], "weekly": [], "model": [], "log_model": []}
    start = FIT_WINDOW_H
    while start + HORIZON_H < len(y):
        stop = min(start + REFIT_EVERY_H, len(y) - HORIZON_H)
        origins = np.arange(start, stop)
        model = HourlyRidgeForecaster(horizon_h=HORIZON_H).fit(y[start - FIT_WINDOW_H : start + 1])
        truth = y[origins[:, None] + np.arange(1, HORIZON_H + 1)[None, :]]
        denom = np.maximum(truth, 1.0)
        errors["naive"].append(np.abs(naive_many(y, origins, 24) - truth) / denom)
        errors["weekly"].append(np.abs(naive_many(y, origins, WEEK_H) - truth) / denom)
        predicted = model.predict_many(y, origins)
        errors["model"].append(np.abs(predicted - truth) / denom)
        errors["log_model"].append(np.log(denom / np.maximum(predicted, 1.0)))
        start = stop
    out = {k: np.concatenate(v) for k, v in errors.items()}
    out["above_upper"] = _above_upper(out["log_model"])
    return out


def _above_upper(log_errors: np.ndarray) -> np.ndarray:
    """1 where the actual exceeded the measured-quantile upper forecast, 0 below, NaN unscored."""
    above = np.full(log_errors.shape, np.nan)
    for i in range(SKILL_WINDOW_H + HORIZON_H, len(log_errors)):
        # Origin i - HORIZON_H is the newest whose every hour is observed by origin i.
        scored = log_errors[i - SKILL_WINDOW_H - HORIZON_H : i - HORIZON_H + 1]
        factor = np.maximum(np.quantile(scored, QUANTILE, axis=0), 0.0)
        above[i] = (log_errors[i] > factor).astype(float)
    return above


def main() -> None:
    """Run the benchmark and print JSON."""
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=default)
    args = parser.parse_args()
    files = sorted((args.data / "carbon").rglob("*.csv"))
    if not files:
        print(f"no carbon series under {args.data / 'carbon'}", file=sys.stderr)
        sys.exit(2)
    per_series = []
    pooled: dict[str, list[np.ndarray]] = {
        "naive": [],
        "weekly": [],
        "model": [],
        "log_model": [],
        "above_upper": [],
    }
    for path in files:
        _, y = to_hourly(load_intensity_csv(path))
        err = evaluate(y)
        for k in pooled:
            pooled[k].append(err[k])
        per_series.append(
            {
                "series": path.name,
                "hours": len(y),
                "forecast_origins": int(err["model"].shape[0]),
                "mape_naive": round(100 * float(err["naive"].mean()), 2),
                "mape_weekly": round(100 * float(err["weekly"].mean()), 2),
                "mape_model": round(100 * float(err["model"].mean()), 2),
                "above_upper_pct": round(100 * float(np.nanmean(err["above_upper"])), 2),
            }
        )
    # Every series counts equally in the summary figures.
    by_h = {
        k: np.mean([e.mean(axis=0) for e in v], axis=0)
        for k, v in pooled.items()
        if k in ("naive", "weekly", "model")
    }
    above_h = np.mean([np.nanmean(e, axis=0) for e in pooled["above_upper"]], axis=0)
    q80_h = np.quantile(np.concatenate(pooled["log_model"]), QUANTILE, axis=0)
    mape_naive = float(np.mean([s["mape_naive"] for s in per_series]))
    mape_model = float(np.mean([s["mape_model"] for s in per_series]))
    result = {
        "series": per_series,
        "horizon_h": HORIZON_H,
        "mape_naive": round(float(np.mean([s["mape_naive"] for s in per_series])), 2),
        "mape_weekly": round(float(np.mean([s["mape_weekly"] for s in per_series])), 2),
        "mape_model": round(mape_model, 2),
        "model_vs_naive_reduction_pct": round(100 * (1 - mape_model / mape_naive), 1),
        "above_upper_pct": round(100 * float(np.mean(above_h)), 2),
        "naive": "same hour yesterday (24 h seasonal naive)",
        "model": "linear model per horizon hour (log space; ridge, then 3 reweighted steps "
        "towards least absolute error) on the last three values, the value 24 h ago, the "
        "target hour on the last two days (and its neighbours) and last week, its 7-day mean, "
        "6 h, same-6 h-yesterday, 24 h and 168 h means; refit weekly on the previous 12 weeks",
        "upper_log_error_q80": [round(float(v), 4) for v in q80_h],
        "per_horizon_hour": [
            {
                "h": h + 1,
                "mape_naive": round(100 * float(by_h["naive"][h]), 2),
                "mape_weekly": round(100 * float(by_h["weekly"][h]), 2),
                "mape_model": round(100 * float(by_h["model"][h]), 2),
                "model_vs_naive_reduction_pct": round(
                    100 * (1 - float(by_h["model"][h]) / float(by_h["naive"][h])), 1
                ),
                "above_upper_pct": round(100 * float(above_h[h]), 2),
            }
            for h in range(HORIZON_H)
        ],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
