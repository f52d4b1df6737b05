"""Queries on carbon_intensity_samples and carbon_forecasts."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler_service.db.models import CarbonForecastRecord, CarbonIntensitySample


class CarbonRepository:
    """All SQL touching the carbon tables."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add_forecast(self, record: CarbonForecastRecord) -> None:
        """Stage a fetched forecast."""
        self.session.add(record)

    def add_sample_once(self, sample: CarbonIntensitySample) -> None:
        """Stage an intensity sample unless one exists for the same region, source, signal and time."""
        exists = self.session.scalar(
            select(CarbonIntensitySample.id).where(
                CarbonIntensitySample.region == sample.region,
                CarbonIntensitySample.source == sample.source,
                CarbonIntensitySample.signal == sample.signal,
                CarbonIntensitySample.at == sample.at,
            )
        )
        if exists is None:
            self.session.add(sample)

    def latest_forecast(self) -> CarbonForecastRecord | None:
        """The newest stored forecast."""
        return self.session.scalar(
            select(CarbonForecastRecord).order_by(CarbonForecastRecord.id.desc()).limit(1)
        )

    def first_fetch_of(self, source_prefix: str) -> datetime | None:
        """When a forecast from a source starting with `source_prefix` was first stored."""
        return self.session.scalar(
            select(CarbonForecastRecord.fetched_at)
            .where(CarbonForecastRecord.source.startswith(source_prefix, autoescape=True))
            .order_by(CarbonForecastRecord.fetched_at)
            .limit(1)
        )

    def observed_since(self, region: str, since: datetime) -> list[CarbonIntensitySample]:
        """Measured (not estimated or assumed) samples of a region since `since`, by time."""
        return list(
            self.session.scalars(
                select(CarbonIntensitySample)
                .where(
                    CarbonIntensitySample.region == region,
                    CarbonIntensitySample.kind == "measured",
                    CarbonIntensitySample.at >= since,
                )
                .order_by(CarbonIntensitySample.at)
            )
        )

    def samples_between(self, start_at: datetime, end_at: datetime) -> list[CarbonIntensitySample]:
        """Intensity samples in [start_at, end_at], plus the last one before start_at, by time."""
        before = self.session.scalar(
            select(CarbonIntensitySample)
            .where(CarbonIntensitySample.at < start_at)
            .order_by(CarbonIntensitySample.at.desc())
            .limit(1)
        )
        inside = list(
            self.session.scalars(
                select(CarbonIntensitySample)
                .where(CarbonIntensitySample.at >= start_at, CarbonIntensitySample.at <= end_at)
                .order_by(CarbonIntensitySample.at)
            )
        )
        return ([before] if before is not None else []) + inside
