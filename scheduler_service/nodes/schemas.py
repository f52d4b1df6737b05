"""Response bodies of the nodes API."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict


class GpuSlotOut(BaseModel):
    """One GPU slot and the job on it."""

    model_config = ConfigDict(from_attributes=True)

    index: int
    uuid: str | None
    memory_mb: int
    job_id: int | None


class NodeOut(BaseModel):
    """A node, its health and its slots."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    agent_url: str
    state: str
    gpu_kind: str
    simulated: bool
    rendezvous_host: str | None = None
    worker_host_port: int | None = None
    registered_at: datetime
    last_heartbeat_at: datetime | None
    heartbeat_age_s: float | None = None
    slots: list[GpuSlotOut]
