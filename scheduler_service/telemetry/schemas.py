"""Response bodies of the telemetry API."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict


class TelemetryOut(BaseModel):
    """One telemetry sample of a job."""

    model_config = ConfigDict(from_attributes=True)

    at: datetime
    node_id: int | None
    """The node that reported it (None for samples stored before nodes were recorded)."""
    interval_s: float
    step: int
    samples_done: int
    samples_per_s: float
    loss: float | None
    gpus: int
    layout: str | None
    power_w: float
    energy_kwh: float
    power_source: str
