"""The emissions ledger: measured energy x PUE x the actual intensity of each interval, per period."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from energy_model.carbon.series import IntensitySeries
from energy_model.emissions import interval_emissions_kg
from scheduler_service.budget.periods import (
    BudgetPeriod,
    PeriodKind,
    period_containing,
    periods_between,
    split_interval,
)
from scheduler_service.budget.repository import LedgerRepository
from scheduler_service.carbon.repository import CarbonRepository
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import LedgerEntry
from scheduler_service.settings import GreenflowConfig
from scheduler_service.telemetry.repository import TelemetryRepository


@dataclass(frozen=True)
class PeriodStatus:
    """A budget period with what it allows and what has been spent."""

    start_at: datetime
    end_at: datetime
    limit_kg: float
    spent_kg: float
    energy_kwh: float

    @property
    def left_kg(self) -> float:
        """Budget not yet spent (never negative)."""
        return max(0.0, self.limit_kg - self.spent_kg)


def _intensity_series(
    session: Session, start_at: datetime, end_at: datetime, conservative: float
) -> IntensitySeries:
    """Measured intensity over [start_at, end_at]; unknown stretches count as the conservative value."""
    samples = CarbonRepository(session).samples_between(start_at, end_at)
    times = [s.at for s in samples]
    values = [s.intensity_g_per_kwh for s in samples]
    if not times or times[0] > start_at:
        # Never assume a cleaner grid than known: before the first sample, charge the conservative value.
        times.insert(0, start_at - timedelta(microseconds=1))
        values.insert(0, conservative)
    return IntensitySeries(tuple(times), tuple(values), source="ledger")


@dataclass(frozen=True)
class ChargedTelemetry:
    """What one charge of new telemetry added: how many samples, and the draw they show now."""

    samples: int
    # Sum over the jobs charged of each one's newest sample (its kg over its seconds): the
    # rate at which the cluster spends now, as far as the telemetry just charged tells.
    rate_kg_per_s: float


def charge_new_telemetry(session: Session, config: GreenflowConfig) -> ChargedTelemetry:
    """Create ledger entries for every telemetry sample not charged yet; say what they show."""
    samples = TelemetryRepository(session).uncharged()
    ledger = LedgerRepository(session)
    pue = config.cluster.pue
    kind: PeriodKind = config.budget.period
    if not samples:
        return ChargedTelemetry(samples=0, rate_kg_per_s=0.0)
    # One step series for the whole batch: a step function read over a wider span charges each
    # interval exactly as a series read for that interval alone would.
    series = _intensity_series(
        session,
        min(s.at - timedelta(seconds=s.interval_s) for s in samples),
        max(s.at for s in samples),
        config.carbon.conservative_intensity_g_per_kwh,
    )
    # job id -> (end of its newest sample, that sample's kg per second).
    newest: dict[int, tuple[datetime, float]] = {}
    for sample in samples:
        sample_kg = 0.0
        end_at = sample.at
        start_at = end_at - timedelta(seconds=sample.interval_s)
        # The agent measured energy; spread it evenly over the interval as an average power.
        power_w = sample.energy_kwh * 3.6e6 / sample.interval_s
        parts = split_interval(start_at, end_at, kind)
        for index, (period, lo, hi) in enumerate(parts):
            share = (hi - lo).total_seconds() / sample.interval_s
            emissions_kg = interval_emissions_kg(power_w, lo, hi, series, pue)
            energy_kwh = sample.energy_kwh * share
            sample_kg += emissions_kg
            ledger.add(
                LedgerEntry(
                    job_id=sample.job_id,
                    # Only the first part carries the sample id (each sample is charged once).
                    telemetry_sample_id=sample.id if index == 0 else None,
                    period_start=period.start_at,
                    period_end=period.end_at,
                    interval_start=lo,
                    interval_end=hi,
                    energy_kwh=energy_kwh,
                    pue=pue,
                    intensity_g_per_kwh=(emissions_kg * 1000 / (energy_kwh * pue))
                    if energy_kwh > 0
                    else 0.0,
                    emissions_kg=emissions_kg,
                )
            )
        # The newest sample, not the batch's average: a job that just grew draws its new power.
        if sample.job_id not in newest or end_at > newest[sample.job_id][0]:
            newest[sample.job_id] = (end_at, sample_kg / sample.interval_s)
    session.flush()
    return ChargedTelemetry(
        samples=len(samples), rate_kg_per_s=sum(rate for _, rate in newest.values())
    )


def period_status(session: Session, config: GreenflowConfig, period: BudgetPeriod) -> PeriodStatus:
    """Limit, spent and energy of one period."""
    ledger = LedgerRepository(session)
    return PeriodStatus(
        start_at=period.start_at,
        end_at=period.end_at,
        limit_kg=config.budget.limit_kg_co2e,
        spent_kg=ledger.spent_kg(period.start_at),
        energy_kwh=ledger.energy_kwh(period.start_at),
    )


def periods_for_horizon(
    session: Session, config: GreenflowConfig, start_at: datetime, end_at: datetime
) -> list[PeriodStatus]:
    """Status of every period the planning horizon touches."""
    return [
        period_status(session, config, p)
        for p in periods_between(start_at, end_at, config.budget.period)
    ]


def current_period(
    session: Session, config: GreenflowConfig, now: datetime | None = None
) -> PeriodStatus:
    """The period running now."""
    return period_status(session, config, period_containing(now or utcnow(), config.budget.period))
