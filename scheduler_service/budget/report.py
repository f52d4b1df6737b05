"""Carbon reports: the ledger of one month (or day) summed per job, queue or user, with energy by
component, emissions, the intensity signal used and the share of energy that was measured.

Location-based, scope-2 style: the electricity the cluster drew x PUE x the grid intensity in
force per interval. `greenflow report` and the console's download both render `build_report`.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy.orm import Session

from scheduler_service.budget.repository import LedgerRepository, ReportRow
from scheduler_service.exceptions import GreenflowError
from scheduler_service.settings import GreenflowConfig

GroupBy = Literal["job", "queue", "user"]
UNATTRIBUTED = "(unattributed)"
# Power sources that are not a measurement (entries older than the sources are "unknown").
UNMEASURED_SOURCES = frozenset({"estimated", "unknown"})
COLUMNS = (
    "key",
    "gpu_energy_kwh",
    "idle_energy_kwh",
    "host_energy_kwh",
    "pue_overhead_kwh",
    "energy_kwh",
    "emissions_kg",
    "measured_share",
    "intensity_source",
    "fallback_intensity",
)
CAVEATS = (
    "Location-based (scope 2 style): energy x PUE x the grid's intensity in force per interval; "
    "no market-based instruments (PPAs, certificates) are applied.",
    "The intensity is the configured provider's signal as recorded; a marginal signal (WattTime "
    "MOER) is not an average one and the two are not comparable.",
    "Intervals with no known intensity are charged at the configured conservative intensity "
    "(fallback_intensity is true on such rows).",
    "Energy labelled 'estimated' comes from the node model or the job's power model, not a meter; "
    "measured_share is the measured part of each row's IT energy.",
    "Idle-GPU and host energy is attributed to the jobs on the node by GPU share; energy of nodes "
    "with no job is the cluster's, reported as the unattributed row.",
    "RAPL covers CPU packages only; host fans, disks and network are in the estimate only where "
    "no RAPL reading exists. PUE is the configured constant, not a measurement.",
)


class PeriodError(GreenflowError):
    """A report period that is not YYYY-MM or YYYY-MM-DD (HTTP 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400)


def parse_period(text: str) -> tuple[datetime, datetime]:
    """[start, end) in UTC of a month `YYYY-MM` or a day `YYYY-MM-DD`."""
    match = re.fullmatch(r"(\d{4})-(\d{2})(?:-(\d{2}))?", text.strip())
    if match is None:
        raise PeriodError(f"period {text!r}: expected YYYY-MM (a month) or YYYY-MM-DD (a day)")
    year, month = int(match.group(1)), int(match.group(2))
    try:
        if match.group(3) is not None:
            start = datetime(year, month, int(match.group(3)), tzinfo=UTC)
            return start, start + timedelta(days=1)
        start = datetime(year, month, 1, tzinfo=UTC)
    except ValueError as exc:
        raise PeriodError(f"period {text!r}: {exc} (expected YYYY-MM or YYYY-MM-DD)") from exc
    end = start.replace(year=year + 1, month=1) if month == 12 else start.replace(month=month + 1)
    return start, end


@dataclass
class ReportLine:
    """One key's energy, emissions and sources."""

    key: str
    gpu_energy_kwh: float = 0.0
    idle_energy_kwh: float = 0.0
    host_energy_kwh: float = 0.0
    pue_overhead_kwh: float = 0.0
    energy_kwh: float = 0.0
    emissions_kg: float = 0.0
    measured_share: float = 0.0
    intensity_source: str = ""
    fallback_intensity: bool = False
    _measured_kwh: float = field(default=0.0, repr=False)
    _sources: dict[str, None] = field(default_factory=dict, repr=False)

    def add(self, row: ReportRow) -> None:
        """Add one ledger group to this line."""
        if row.component == "idle":
            self.idle_energy_kwh += row.energy_kwh
        elif row.component == "host":
            self.host_energy_kwh += row.energy_kwh
        else:
            self.gpu_energy_kwh += row.energy_kwh
        self.pue_overhead_kwh += row.pue_overhead_kwh
        self.energy_kwh += row.energy_kwh + row.pue_overhead_kwh
        self.emissions_kg += row.emissions_kg
        if row.power_source not in UNMEASURED_SOURCES:
            self._measured_kwh += row.energy_kwh
        for label in row.intensity_source.split("; "):
            if label:
                self._sources[label] = None
        it_kwh = self.gpu_energy_kwh + self.idle_energy_kwh + self.host_energy_kwh
        self.measured_share = self._measured_kwh / it_kwh if it_kwh > 0 else 0.0
        self.intensity_source = "; ".join(sorted(self._sources))
        self.fallback_intensity = "conservative" in self._sources

    def public(self) -> dict[str, object]:
        """The line's columns (without the running sums)."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


@dataclass(frozen=True)
class Report:
    """A period's report: one line per key, their total, the signal and the caveats."""

    period: str
    start_at: datetime
    end_at: datetime
    by: GroupBy
    signal: str
    lines: list[ReportLine]
    total: ReportLine
    caveats: tuple[str, ...] = CAVEATS

    def as_json(self) -> dict[str, object]:
        """The report as a JSON-ready mapping."""
        return {
            "period": self.period,
            "start_at": self.start_at.isoformat(),
            "end_at": self.end_at.isoformat(),
            "by": self.by,
            "signal": self.signal,
            "columns": list(COLUMNS),
            "rows": [line.public() for line in self.lines],
            "total": self.total.public(),
            "caveats": list(self.caveats),
        }


def _key(row: ReportRow, by: GroupBy) -> str:
    if row.job_id is None:
        return UNATTRIBUTED
    if by == "job":
        return str(row.job_id)
    if by == "queue":
        return row.queue or UNATTRIBUTED
    return row.owner or UNATTRIBUTED


def build_report(
    session: Session,
    config: GreenflowConfig,
    period: str,
    by: GroupBy,
    owner: str | None = None,
) -> Report:
    """The ledger of `period` per job, queue or user (only `owner`'s jobs when given)."""
    start_at, end_at = parse_period(period)
    rows = LedgerRepository(session).report_rows(start_at, end_at, owner=owner)
    lines: dict[str, ReportLine] = {}
    total = ReportLine(key="total")
    for row in rows:
        key = _key(row, by)
        lines.setdefault(key, ReportLine(key=key)).add(row)
        total.add(row)

    def order(line: ReportLine) -> tuple[int, int, str]:
        # Jobs by id, other keys by name; the unattributed row last.
        unattributed = line.key == UNATTRIBUTED
        numeric = line.key.isdigit()
        return (int(unattributed), int(line.key) if numeric else 0, line.key)

    carbon = config.carbon
    return Report(
        period=period,
        start_at=start_at,
        end_at=end_at,
        by=by,
        signal=f"provider {carbon.provider}, region {carbon.region}; location-based average "
        "unless the provider's signal is marginal (see intensity_source)",
        lines=sorted(lines.values(), key=order),
        total=total,
    )


def csv_from_json(data: Mapping[str, Any]) -> str:
    """A report's rows and total as CSV (header row first), from its JSON form."""
    buffer = io.StringIO()
    writer = csv.DictWriter(
        buffer, fieldnames=list(COLUMNS), lineterminator="\n", extrasaction="ignore"
    )
    writer.writeheader()
    for line in [*data["rows"], data["total"]]:
        writer.writerow(line)
    return buffer.getvalue()


def report_csv(report: Report) -> str:
    """The report as CSV: what the console downloads and `greenflow report` prints."""
    return csv_from_json(report.as_json())
