"""Service settings (environment) and the operator's `greenflow.toml` (budget, carbon, planner, cluster)."""

from __future__ import annotations

import os
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConfigError(Exception):
    """The config file or environment is invalid; the message names the key and what is allowed."""


class Settings(BaseSettings):
    """Process settings, read from `GREENFLOW_*` environment variables."""

    model_config = SettingsConfigDict(env_prefix="GREENFLOW_", extra="ignore")

    database_url: str = Field(
        default_factory=lambda: f"sqlite:///{Path.cwd() / 'greenflow.db'}",
        description="SQLAlchemy URL; default a SQLite file in the working directory.",
    )
    config: Path | None = Field(default=None, description="Path of greenflow.toml.")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # Off in tests and for API-only replicas; `greenflow serve` turns it on.
    run_control_loop: bool = True


class BudgetConfig(BaseModel):
    """The carbon budget: a limit per period, enforced hard or priced softly."""

    model_config = ConfigDict(extra="forbid")

    period: Literal["day", "week", "month"] = "day"
    limit_kg_co2e: Annotated[float, Field(gt=0)] = 50.0
    enforcement: Literal["hard", "soft"] = "hard"
    # Soft mode: how many seconds of weighted completion time one kg CO2e is worth.
    soft_price_s_per_kg: Annotated[float, Field(ge=0)] = 3600.0


class CarbonConfig(BaseModel):
    """Where carbon intensity comes from and what to assume when it cannot be had."""

    model_config = ConfigDict(extra="forbid")

    provider: Literal[
        "synthetic", "trace", "electricitymaps", "watttime", "uk", "carbon-aware-sdk"
    ] = "synthetic"
    region: str = "local"
    api_key_env: str | None = None
    base_url: str | None = None
    trace_path: Path | None = None
    # Trace and synthetic providers replay this many trace seconds per wall-clock second.
    clock_speedup: Annotated[float, Field(gt=0)] = 1.0
    # Trace/synthetic providers: "model" forecasts from the replayed past (as a real provider
    # would); "oracle" reveals the trace's own future (a perfect forecast, for experiments).
    forecast_mode: Literal["model", "oracle"] = "model"
    seed: int = 0
    conservative_intensity_g_per_kwh: Annotated[float, Field(gt=0)] = 500.0
    max_forecast_age_s: Annotated[int, Field(gt=0)] = 3600

    def api_key(self) -> str | None:
        """The API key from the environment variable the config names, if any."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None


PolicyName = Literal["greenflow", "carbon-agnostic", "static", "carbon-greedy", "shift"]


def default_budget_check_s(slot_s: float) -> float:
    """The budget watchdog's check interval when none is set: a fifth of a slot, within 1-300 s."""
    return min(max(slot_s / 5, 1.0), 300.0)


class PlannerConfig(BaseModel):
    """Slot length and horizon of the allocation plan."""

    model_config = ConfigDict(extra="forbid")

    slot_s: Annotated[int, Field(ge=1, le=86_400)] = 300
    horizon_s: Annotated[int, Field(ge=60, le=14 * 86_400)] = 86_400
    solver_time_limit_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    # How often, between ticks, the loop records the intensity now, charges new telemetry and
    # checks the hard budget (the budget watchdog); None: slot_s / 5, within 1-300 s.
    budget_check_interval_s: Annotated[float | None, Field(gt=0, le=3600)] = None
    # The least time (s) the budget watchdog allows a tick to solve and push a stop, when the
    # last tick measured took less: it wakes the tick this much (plus a check interval and a
    # telemetry report) before the spend would reach the hard budget.
    tick_latency_floor_s: Annotated[float, Field(ge=0, le=600)] = 2.0
    # A failed tick (a database error, say) is tried again after this many seconds, twice as
    # long after each further failure in a row, at most slot_s; a wake still ticks at once.
    tick_retry_initial_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    # The allocation policy the control loop and admission both use (names of POLICIES).
    policy: PolicyName = "greenflow"
    seed: int = 0

    def budget_check_s(self) -> float:
        """Seconds between the loop's intensity samples and budget checks."""
        if self.budget_check_interval_s is not None:
            return self.budget_check_interval_s
        return default_budget_check_s(self.slot_s)


class ClusterConfig(BaseModel):
    """Facts about the data centre that the energy arithmetic needs."""

    model_config = ConfigDict(extra="forbid")

    pue: Annotated[float, Field(ge=1.0, le=3.0)] = 1.2
    idle_power_per_gpu_w: Annotated[float, Field(ge=0, le=2000)] = 60.0
    heartbeat_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    # How often agents heartbeat and report telemetry (told to them at registration).
    agent_heartbeat_interval_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    agent_telemetry_interval_s: Annotated[float, Field(gt=0, le=3600)] = 5.0


class GreenflowConfig(BaseModel):
    """The whole `greenflow.toml`."""

    model_config = ConfigDict(extra="forbid")

    budget: BudgetConfig = BudgetConfig()
    carbon: CarbonConfig = CarbonConfig()
    planner: PlannerConfig = PlannerConfig()
    cluster: ClusterConfig = ClusterConfig()

    @field_validator("planner")
    @classmethod
    def _horizon_covers_a_slot(cls, planner: PlannerConfig) -> PlannerConfig:
        if planner.horizon_s < planner.slot_s:
            raise ValueError(
                f"horizon_s ({planner.horizon_s}) must be at least slot_s ({planner.slot_s})"
            )
        return planner


def _describe_error(error: Any) -> str:
    key = ".".join(str(part) for part in error["loc"])
    value = error.get("input")
    allowed = error["msg"]
    ctx = error.get("ctx") or {}
    if "expected" in ctx:
        allowed = f"expected {ctx['expected']}"
    if error["type"] == "extra_forbidden":
        return f"unknown key '{key}' (value {value!r}); remove it or check its spelling"
    return f"invalid value for '{key}': {value!r} ({allowed})"


def load_config(path: Path | None) -> GreenflowConfig:
    """Read and validate `greenflow.toml`; defaults when `path` is None; `ConfigError` on bad input."""
    if path is None:
        return GreenflowConfig()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist (GREENFLOW_CONFIG)") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    try:
        return GreenflowConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"config file {path}: {_describe_error(first)}") from exc


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings object."""
    return Settings()
