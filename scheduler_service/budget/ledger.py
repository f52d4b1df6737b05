"""The emissions ledger: measured energy x PUE x the actual intensity of each interval, per period."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from energy_model.carbon.series import IntensitySeries
from energy_model.emissions import GRAMS_PER_KG, J_PER_KWH, interval_emissions_kg
from scheduler_service.budget.periods import (
    BudgetPeriod,
    PeriodStatus,
    ReplayClock,
    period_containing,
    periods_between,
    replay_clock,
    split_interval,
)
from scheduler_service.budget.repository import LedgerRepository
from scheduler_service.carbon.repository import CarbonRepository
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import NodePowerSampleRow
from scheduler_service.settings import BudgetConfig, GreenflowConfig
from scheduler_service.telemetry.repository import NodePowerRepository, TelemetryRepository

CONSERVATIVE_LABEL = "conservative"


@dataclass(frozen=True)
class LabelledSeries:
    """The intensity in force as a step series, with what each step came from."""

    series: IntensitySeries
    labels: tuple[str, ...]

    def sources_over(self, start_at: datetime, end_at: datetime) -> str:
        """The labels of every step in force during [start_at, end_at), joined by '; '."""
        times = self.series.times
        first = max(0, bisect_right(times, start_at) - 1)
        last = max(first, bisect_left(times, end_at) - 1)
        return "; ".join(dict.fromkeys(self.labels[first : last + 1]))


def _intensity_series(
    session: Session, start_at: datetime, end_at: datetime, conservative: float
) -> LabelledSeries:
    """Measured intensity over [start_at, end_at]; unknown stretches count as the conservative value."""
    samples = CarbonRepository(session).samples_between(start_at, end_at)
    times = [s.at for s in samples]
    values = [s.intensity_g_per_kwh for s in samples]
    labels = [f"{s.source} {s.signal} {s.region} ({s.kind})" for s in samples]
    if not times or times[0] > start_at:
        # Never assume a cleaner grid than known: before the first sample, charge the conservative value.
        times.insert(0, start_at - timedelta(microseconds=1))
        values.insert(0, conservative)
        labels.insert(0, CONSERVATIVE_LABEL)
    return LabelledSeries(
        IntensitySeries(tuple(times), tuple(values), source="ledger"), tuple(labels)
    )


@dataclass(frozen=True)
class ChargedTelemetry:
    """What one charge of new telemetry added: how many samples, and the draw they show now."""

    samples: int
    # Sum over the jobs charged of each one's newest sample (its kg over its seconds), plus each
    # node's newest idle-GPU and host draw: the rate at which the cluster spends now, as far as
    # the telemetry just charged tells.
    rate_kg_per_s: float
    node_power_samples: int = 0


def _entries_for(
    ledger: LedgerRepository,
    series: LabelledSeries,
    budget: BudgetConfig,
    pue: float,
    start_at: datetime,
    end_at: datetime,
    energy_j: float,
    template: dict[str, Any],
    clock: ReplayClock | None = None,
) -> float:
    """Stage the ledger entries of `energy_j` spread evenly over [start_at, end_at), one per
    budget period it touches; return their kg."""
    interval_s = (end_at - start_at).total_seconds()
    created_at = utcnow()
    # Spread the measured energy evenly over the interval as an average power.
    power_w = energy_j / interval_s
    total_kg = 0.0
    for index, (period, lo, hi) in enumerate(
        split_interval(start_at, end_at, budget.period, budget.time_zone, clock)
    ):
        share = (hi - lo).total_seconds() / interval_s
        emissions_kg = interval_emissions_kg(power_w, lo, hi, series.series, pue)
        energy_kwh = energy_j / J_PER_KWH * share
        total_kg += emissions_kg
        fields = dict(template)
        if index > 0:
            # Only the first part carries the sample id (each sample is charged once).
            fields["telemetry_sample_id"] = None
        ledger.stage(
            {
                **fields,
                "period_start": period.start_at,
                "period_end": period.end_at,
                "interval_start": lo,
                "interval_end": hi,
                "energy_kwh": energy_kwh,
                "pue": pue,
                "intensity_g_per_kwh": (emissions_kg * GRAMS_PER_KG / (energy_kwh * pue))
                if energy_kwh > 0
                else 0.0,
                "emissions_kg": emissions_kg,
                "intensity_source": series.sources_over(lo, hi),
                "created_at": created_at,
            }
        )
    return total_kg


def attribution_shares(holders: dict[int, int]) -> dict[int | None, float]:
    """How a node interval's idle-GPU and host energy is split: among the jobs holding its GPUs
    at the end of the interval, by their GPU count (GPU-time share); to the cluster (None) when
    no job holds one."""
    total = sum(holders.values())
    if total <= 0:
        return {None: 1.0}
    return {job_id: count / total for job_id, count in sorted(holders.items())}


def _split_exactly(
    energy_j: float, shares: dict[int | None, float]
) -> list[tuple[int | None, float]]:
    """`energy_j` cut by `shares`; the last part takes the remainder so the parts sum to it."""
    parts: list[tuple[int | None, float]] = []
    given = 0.0
    items = list(shares.items())
    for i, (job_id, share) in enumerate(items):
        part = energy_j - given if i == len(items) - 1 else energy_j * share
        given += part
        parts.append((job_id, part))
    return parts


def charge_new_telemetry(session: Session, config: GreenflowConfig) -> ChargedTelemetry:
    """Create ledger entries for every telemetry and node power sample not charged yet; say what
    they show.

    Busy GPUs are charged from their job's own telemetry; idle GPUs and the host from the
    nodes' power samples, attributed to the jobs on the node by GPU share (`attribution_shares`)
    and kept as component "idle"/"host" entries, so the cluster's overhead is always visible."""
    telemetry = TelemetryRepository(session)
    samples = telemetry.uncharged()
    node_samples = NodePowerRepository(session).uncharged()
    ledger = LedgerRepository(session)
    pue = config.cluster.pue
    budget = config.budget
    if not samples and not node_samples:
        return ChargedTelemetry(samples=0, rate_kg_per_s=0.0)
    spans = [(s.at - timedelta(seconds=s.interval_s), s.at) for s in samples] + [
        (s.at - timedelta(seconds=s.interval_s), s.at) for s in node_samples
    ]
    # One step series for the whole batch: a step function read over a wider span charges each
    # interval exactly as a series read for that interval alone would.
    series = _intensity_series(
        session,
        min(lo for lo, _ in spans),
        max(hi for _, hi in spans),
        config.carbon.conservative_intensity_g_per_kwh,
    )
    # job id -> (end of its newest sample, that sample's kg per second).
    newest: dict[int, tuple[datetime, float]] = {}
    for sample in samples:
        end_at = sample.at
        sample_kg = _entries_for(
            ledger,
            series,
            budget,
            pue,
            end_at - timedelta(seconds=sample.interval_s),
            end_at,
            sample.energy_kwh * J_PER_KWH,
            {
                "job_id": sample.job_id,
                "telemetry_sample_id": sample.id,
                "component": "gpu",
                "power_source": sample.power_source,
                "node_id": sample.node_id,
            },
            period_clock(config),
        )
        # The newest sample, not the batch's average: a job that just grew draws its new power.
        if sample.job_id not in newest or end_at > newest[sample.job_id][0]:
            newest[sample.job_id] = (end_at, sample_kg / sample.interval_s)
    # node id -> (end of its newest power sample, that sample's overhead kg per second).
    newest_node: dict[int | None, tuple[datetime, float]] = {}
    for node_sample in node_samples:
        node_kg = _charge_node_sample(
            ledger, series, budget, pue, node_sample, period_clock(config)
        )
        key = node_sample.node_id
        if key not in newest_node or node_sample.at > newest_node[key][0]:
            newest_node[key] = (node_sample.at, node_kg / node_sample.interval_s)
    ledger.insert_staged()
    telemetry.mark_charged([s.id for s in samples])
    session.flush()
    return ChargedTelemetry(
        samples=len(samples) + len(node_samples),
        rate_kg_per_s=sum(rate for _, rate in newest.values())
        + sum(rate for _, rate in newest_node.values()),
        node_power_samples=len(node_samples),
    )


def _charge_node_sample(
    ledger: LedgerRepository,
    series: LabelledSeries,
    budget: BudgetConfig,
    pue: float,
    sample: NodePowerSampleRow,
    clock: ReplayClock | None = None,
) -> float:
    """Charge one node sample's idle-GPU and host energy; mark it charged; return its kg."""
    end_at = sample.at
    start_at = end_at - timedelta(seconds=sample.interval_s)
    holders: dict[int, int] = {}
    overhead: dict[tuple[str, str], float] = {}
    for reading in sample.readings:
        if reading.component == "gpu" and reading.job_id is not None:
            # A busy GPU: its job's own telemetry charges it.
            holders[reading.job_id] = holders.get(reading.job_id, 0) + 1
            continue
        component = "host" if reading.component == "host" else "idle"
        key = (component, reading.source)
        overhead[key] = overhead.get(key, 0.0) + reading.energy_j
    shares = attribution_shares(holders)
    total_kg = 0.0
    for (component, source), energy_j in sorted(overhead.items()):
        if energy_j <= 0:
            continue
        for job_id, part_j in _split_exactly(energy_j, shares):
            total_kg += _entries_for(
                ledger,
                series,
                budget,
                pue,
                start_at,
                end_at,
                part_j,
                {
                    "job_id": job_id,
                    "component": component,
                    "power_source": source,
                    "node_id": sample.node_id,
                    "node_power_sample_id": sample.id,
                },
                clock,
            )
    sample.charged = True
    return total_kg


def period_clock(config: GreenflowConfig) -> ReplayClock | None:
    """The clock the budget periods run on: with `budget.period_clock = "carbon"` the carbon
    clock of the replay this process runs (its series' calendar, compressed like the replay);
    None, the wall clock, otherwise and where no replay runs (a live provider's carbon clock is
    the wall clock)."""
    return replay_clock() if config.budget.period_clock == "carbon" else None


def budget_period(config: GreenflowConfig, at: datetime) -> BudgetPeriod:
    """The budget period (of the configured kind and time zone) that contains `at`."""
    return period_containing(
        at, config.budget.period, config.budget.time_zone, period_clock(config)
    )


def period_status(
    session: Session, config: GreenflowConfig, period: BudgetPeriod, team: str | None = None
) -> PeriodStatus:
    """Limit, spent and energy of one period: the cluster's, or one team's (its queues' jobs)."""
    ledger = LedgerRepository(session)
    queues = None if team is None else config.budget.teams[team].queues
    limit = config.budget.limit_kg_co2e if team is None else config.budget.teams[team].limit_kg_co2e
    spent_kg, energy_kwh = ledger.period_sums(period.start_at, period.end_at, queues)
    return PeriodStatus(
        start_at=period.start_at,
        end_at=period.end_at,
        limit_kg=limit,
        spent_kg=spent_kg,
        energy_kwh=energy_kwh,
    )


def team_statuses(
    session: Session, config: GreenflowConfig, now: datetime | None = None
) -> dict[str, PeriodStatus]:
    """Each team budget's current period."""
    period = budget_period(config, now or utcnow())
    return {team: period_status(session, config, period, team) for team in config.budget.teams}


def spent_team_queues(
    session: Session, config: GreenflowConfig, now: datetime | None = None
) -> dict[str, set[str]]:
    """Queues whose team budget has nothing left this period, by the team's enforcement
    ("hard": its jobs get no GPUs until the next period; "soft": they are planned at the lowest
    priority, after every other team's)."""
    out: dict[str, set[str]] = {"hard": set(), "soft": set()}
    for team, status in team_statuses(session, config, now).items():
        budget = config.budget.teams[team]
        if status.left_kg <= 0:
            out[budget.enforcement].update(budget.queues)
    return out


def exhausted_hard_queues(
    session: Session, config: GreenflowConfig, now: datetime | None = None
) -> set[str]:
    """Queues whose team has a hard budget with nothing left this period: their jobs get no GPUs
    until the next period (other teams' jobs are not affected)."""
    return spent_team_queues(session, config, now)["hard"]


OVERHEAD_WINDOW_S = 900.0
"""How far back the nodes' idle-GPU and host draw is averaged for the planner's reserve."""


def overhead_reserve_kg(
    session: Session, config: GreenflowConfig, start_at: datetime, end_at: datetime
) -> float:
    """Emissions the nodes' idle-GPU and host draw will add over [start_at, end_at): their
    average power over the last `OVERHEAD_WINDOW_S` (from the node power samples) x PUE x the
    latest known intensity (the conservative one when none is known). Conservative: GPUs idle
    now count as idle for the whole period, although jobs planned on them stop their idle draw."""
    seconds = (end_at - start_at).total_seconds()
    if seconds <= 0:
        return 0.0
    power_w = NodePowerRepository(session).overhead_power_w(start_at, OVERHEAD_WINDOW_S)
    if power_w <= 0:
        return 0.0
    latest = CarbonRepository(session).samples_between(start_at, start_at)
    intensity = (
        latest[-1].intensity_g_per_kwh if latest else config.carbon.conservative_intensity_g_per_kwh
    )
    kwh = power_w * seconds / J_PER_KWH * config.cluster.pue
    return kwh * intensity / GRAMS_PER_KG


def periods_for_horizon(
    session: Session, config: GreenflowConfig, start_at: datetime, end_at: datetime
) -> list[PeriodStatus]:
    """Status of every period the planning horizon touches, with the nodes' overhead until each
    period's end reserved: the planner plans jobs only into what the overhead leaves."""
    budget = config.budget
    out = []
    clock = period_clock(config)
    for p in periods_between(start_at, end_at, budget.period, budget.time_zone, clock):
        status = period_status(session, config, p)
        reserve = overhead_reserve_kg(session, config, max(p.start_at, start_at), p.end_at)
        out.append(replace(status, reserved_kg=reserve))
    return out


def team_periods_for_horizon(
    session: Session, config: GreenflowConfig, start_at: datetime, end_at: datetime
) -> dict[str, list[PeriodStatus]]:
    """Per team with a hard budget, the status of every period the planning horizon touches
    (what its jobs may still spend; the nodes' overhead is reserved in the cluster's budget)."""
    budget = config.budget
    periods = list(
        periods_between(start_at, end_at, budget.period, budget.time_zone, period_clock(config))
    )
    return {
        team: [period_status(session, config, p, team) for p in periods]
        for team, team_budget in budget.teams.items()
        if team_budget.enforcement == "hard"
    }


def current_period(
    session: Session, config: GreenflowConfig, now: datetime | None = None
) -> PeriodStatus:
    """The period running now."""
    return period_status(session, config, budget_period(config, now or utcnow()))
