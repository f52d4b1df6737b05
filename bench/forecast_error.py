"""24 h carbon-intensity forecast error of the ridge model vs seasonal-naive baselines.

Rolling origin on each real series in ../shared/data/carbon: every hour is a forecast origin;
the ridge model is refitted every week on the previous 12 weeks (the library refits on the
latest 12 weeks at every call) and never sees the values it forecasts. Prints JSON.
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


def evaluate(y: np.ndarray) -> dict[str, np.ndarray]:
    """Absolute percentage errors (origins, horizon) of each method on one hourly series."""
    errors: dict[str, list[np.ndarray]] = {"naive": [], "weekly": [], "model": []}
    start = FIT_WINDOW_H
    while start + HORIZON_H < len(y):
        stop = min(start + REFIT_EVERY_H, len(y) - HORIZON_H)
        origins = np.arange(start, stop)
        model = HourlyRidgeForecaster(horizon_h=HORIZON_H).fit(y[start - FIT_WINDOW_H : start + 1])
        truth = y[origins[:, None] + np.arange(1, HORIZON_H + 1)[None, :]]
        denom = np.maximum(truth, 1.0)
        errors["naive"].append(np.abs(naive_many(y, origins, 24) - truth) / denom)
        errors["weekly"].append(np.abs(naive_many(y, origins, WEEK_H) - truth) / denom)
        errors["model"].append(np.abs(model.predict_many(y, origins) - truth) / denom)
        start = stop
    return {k: np.concatenate(v) for k, v in errors.items()}


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
    pooled: dict[str, list[np.ndarray]] = {"naive": [], "weekly": [], "model": []}
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
            }
        )
    # Every series counts equally in the summary figures.
    by_h = {k: np.mean([e.mean(axis=0) for e in v], axis=0) for k, v in pooled.items()}
    result = {
        "series": per_series,
        "horizon_h": HORIZON_H,
        "mape_naive": round(float(np.mean([s["mape_naive"] for s in per_series])), 2),
        "mape_weekly": round(float(np.mean([s["mape_weekly"] for s in per_series])), 2),
        "mape_model": round(float(np.mean([s["mape_model"] for s in per_series])), 2),
        "naive": "same hour yesterday (24 h seasonal naive)",
        "model": "ridge per horizon hour (log space) on the last two values, the target hour "
        "on the last two days and last week, its 7-day mean, 24 h and 168 h means; "
        "refit weekly on the previous 12 weeks",
        "per_horizon_hour": [
            {
                "h": h + 1,
                "mape_naive": round(100 * float(by_h["naive"][h]), 2),
                "mape_weekly": round(100 * float(by_h["weekly"][h]), 2),
                "mape_model": round(100 * float(by_h["model"][h]), 2),
            }
            for h in range(HORIZON_H)
        ],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
