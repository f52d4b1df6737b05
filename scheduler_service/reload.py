"""Reloading `greenflow.toml` without a restart: SIGHUP or `POST /v1/config/reload` (operators).

The file is read and validated exactly as at start; a bad file is refused with the same one-line
message and the running config stays. Budgets (teams, limits, enforcement, time zone), planner,
cluster energy figures and workload rules apply from the next request and tick; the carbon
provider and the agents' reporting intervals are fixed at start, so a change to them is refused
(it needs a restart).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request

from scheduler_service.deps import Operator
from scheduler_service.exceptions import GreenflowError, error_responses
from scheduler_service.settings import ConfigError, GreenflowConfig, load_config

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["config"], responses=error_responses(401, 403))

# Read once at start: changing these needs a restart.
FIXED_AT_START = (
    ("carbon", lambda c: c.carbon),
    ("cluster.agent_heartbeat_interval_s", lambda c: c.cluster.agent_heartbeat_interval_s),
    ("cluster.agent_telemetry_interval_s", lambda c: c.cluster.agent_telemetry_interval_s),
)


class ReloadRefused(GreenflowError):
    """The file is invalid, or changes what only a restart applies (HTTP 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400)


@dataclass(frozen=True)
class Reloaded:
    """The sections whose values changed."""

    changed: list[str]


def changed_sections(old: GreenflowConfig, new: GreenflowConfig) -> list[str]:
    """Top-level sections of the config whose values differ."""
    return [
        name for name in GreenflowConfig.model_fields if getattr(old, name) != getattr(new, name)
    ]


def reload_config(app: FastAPI) -> Reloaded:
    """Read the config file again and apply it to the app and its control loop; `ReloadRefused`
    (the running config kept) when the file is bad or changes what needs a restart."""
    path = app.state.settings.config
    old: GreenflowConfig = app.state.config
    try:
        new = load_config(path)
    except ConfigError as exc:
        raise ReloadRefused(f"{exc}; the running config is kept") from exc
    for name, read in FIXED_AT_START:
        if read(old) != read(new):
            raise ReloadRefused(
                f"config file {path}: {name} changed; it applies only at a restart "
                "(the running config is kept)"
            )
    changed = changed_sections(old, new)
    app.state.config = new
    admission = getattr(app.state, "admission", None)
    if admission is not None:
        admission.config = new
    loop = app.state.control_loop
    if loop is not None:
        loop.config = new
        loop.wake()
    log.info("config %s reloaded (changed: %s)", path, ", ".join(changed) or "nothing")
    return Reloaded(changed)


def reload_on_signal(app: FastAPI) -> None:
    """The SIGHUP handler: reload, or log why not and keep the running config."""
    try:
        reload_config(app)
    except ReloadRefused as exc:
        log.error("config reload refused: %s", exc.message)


@router.post("/config/reload", responses=error_responses(400))
def reload(request: Request, _operator: Operator) -> dict[str, Any]:
    """Read greenflow.toml again and apply it (as SIGHUP does); a bad file is refused with the
    reason and the running config stays."""
    return {"reloaded": True, "changed": reload_config(request.app).changed}
