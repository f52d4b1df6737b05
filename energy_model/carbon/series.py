"""Carbon-intensity series read from CSV files (Electricity Maps export or `time,intensity`)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

# Column names of the Electricity Maps hourly export; LCA is the default signal.
EM_TIME_COLUMN = "Datetime (UTC)"
EM_LCA_COLUMN = "Carbon Intensity gCO₂eq/kWh (LCA)"
EM_DIRECT_COLUMN = "Carbon Intensity gCO₂eq/kWh (direct)"


@dataclass(frozen=True)
class IntensitySeries:
    """Carbon intensity (g CO2e/kWh) at increasing UTC times; each value holds until the next."""

    times: tuple[datetime, ...]
    intensity_g_per_kwh: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        if len(self.times) != len(self.intensity_g_per_kwh):
            raise ValueError("times and intensity_g_per_kwh differ in length")
        if not self.times:
            raise ValueError(f"{self.source}: empty intensity series")
        if any(b <= a for a, b in zip(self.times, self.times[1:], strict=False)):
            raise ValueError(f"{self.source}: times must be strictly increasing")


def _parse_time(text: str) -> datetime:
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def load_intensity_csv(path: Path, column: str | None = None) -> IntensitySeries:
    """Read an Electricity Maps hourly export (LCA column by default) or a `time,intensity` CSV."""
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        fields = reader.fieldnames or []
        if EM_TIME_COLUMN in fields:
            time_col, value_col = EM_TIME_COLUMN, column or EM_LCA_COLUMN
        elif {"time", "intensity"} <= set(fields):
            time_col, value_col = "time", column or "intensity"
        else:
            raise ValueError(
                f"{path}: expected columns {EM_TIME_COLUMN!r} (Electricity Maps export) "
                f"or 'time,intensity', found {fields}"
            )
        if value_col not in fields:
            raise ValueError(f"{path}: no column {value_col!r}; columns are {fields}")
        times: list[datetime] = []
        values: list[float] = []
        for line_no, row in enumerate(reader, start=2):
            raw = (row.get(value_col) or "").strip()
            if not raw:
                continue  # gaps are left to the forecaster, not invented here
            try:
                times.append(_parse_time(row[time_col]))
                values.append(float(raw))
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: {exc}") from exc
    return IntensitySeries(tuple(times), tuple(values), source=str(path))
