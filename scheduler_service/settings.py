"""Service settings (environment) and the operator's `greenflow.toml` (budget, carbon, planner, cluster)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from energy_model.carbon.factory import CarbonConfig


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
    # Failed sign-ins / bearer checks an address may make (in 5 minutes) before it must wait.
    auth_failures_free: int = Field(default=5, ge=1, le=1_000_000)
    # Seconds a process reuses a token it authenticated (0: look it up on every request); a
    # revoked token stops working within this time.
    auth_cache_s: float = Field(default=5.0, ge=0.0, le=60.0)
    # Larger request bodies are refused (413) before they are read.
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    # Largest workdir bundle (the packed job code) a user may upload (PUT /v1/bundles/...).
    max_bundle_bytes: int = Field(default=20 << 20, ge=1024, le=1 << 30)
    # The key the scheduler derives its per-node secrets toward agents from (never stored in the
    # database). Every replica needs the same key: set it, or the file, in production.
    secret_key: SecretStr | None = Field(
        default=None, description="Scheduler key (GREENFLOW_SECRET_KEY), at least 32 characters."
    )
    secret_key_file: Path | None = Field(
        default=None,
        description="File holding the scheduler key; default greenflow.key beside the SQLite "
        "database or in the working directory, created on first start when missing.",
    )


class TeamBudget(BaseModel):
    """A team's budget (`[budget.teams.<name>]`): what the jobs of its queues may emit per period."""

    model_config = ConfigDict(extra="forbid")

    queues: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(min_length=1)]
    limit_kg_co2e: Annotated[float, Field(gt=0)]
    enforcement: Literal["hard", "soft"] = "hard"


def _valid_time_zone(name: str) -> str:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(
            f"unknown time zone {name!r} (an IANA name such as Europe/Berlin)"
        ) from exc
    return name


class BudgetConfig(BaseModel):
    """The carbon budget: a cluster-wide limit per period, enforced hard or priced softly, and
    optional per-team budgets under it (each job draws on the budget of its queue's team)."""

    model_config = ConfigDict(extra="forbid")

    period: Literal["day", "week", "month"] = "day"
    limit_kg_co2e: Annotated[float, Field(gt=0)] = 50.0
    enforcement: Literal["hard", "soft"] = "hard"
    # Soft mode: how many seconds of weighted completion time one kg CO2e is worth.
    soft_price_s_per_kg: Annotated[float, Field(ge=0)] = 3600.0
    # Periods start at local midnight (Monday, the 1st) of this IANA time zone.
    time_zone: Annotated[str, AfterValidator(_valid_time_zone)] = "UTC"
    # "carbon": periods follow the calendar of the series a trace/synthetic replay plays,
    # compressed like it (`carbon.clock_speedup`: a day lasts 86,400 s / speedup, a month its
    # 28-31 series days; `budget/periods.py`, `ReplayClock`), e.g. the demo's; without a replay,
    # the wall clock. "wall": on the wall clock whatever the replay's speed.
    period_clock: Literal["wall", "carbon"] = "wall"
    # Under a hard budget: the quantile the forecast (not yet measured) part of the slot about to
    # run is planned with. What that step spends is committed before the next plan can correct
    # it; later slots are planned again once measured, with `carbon.forecast_quantile`. 0.5 or
    # at most `carbon.forecast_quantile`: no such reserve.
    commit_quantile: Annotated[float, Field(ge=0.5, lt=1.0)] = 0.999
    teams: dict[Annotated[str, Field(min_length=1, max_length=64)], TeamBudget] = {}

    @model_validator(mode="after")
    def _queues_in_one_team(self) -> BudgetConfig:
        owner: dict[str, str] = {}
        for team, budget in self.teams.items():
            for queue in budget.queues:
                if queue in owner:
                    raise ValueError(
                        f"queue {queue!r} is in the budgets of both {owner[queue]!r} and {team!r}"
                    )
                owner[queue] = team
        return self

    def team_of(self, queue: str) -> str | None:
        """The team whose budget a job of `queue` draws on (None: the cluster's only)."""
        for team, budget in self.teams.items():
            if queue in budget.queues:
                return team
        return None


PolicyName = Literal["greenflow", "carbon-agnostic", "static", "carbon-greedy", "shift"]


def default_budget_check_s(slot_s: float) -> float:
    """The budget watchdog's check interval when none is set: a fifth of a slot, within 1-300 s."""
    return min(max(slot_s / 5, 1.0), 300.0)


def default_solver_time_limit_s(slot_s: float) -> float:
    """A solve's time limit when none is set: a sixtieth of a slot, within 2-60 s."""
    return min(max(slot_s / 60, 2.0), 60.0)


class PlannerConfig(BaseModel):
    """Slot length and horizon of the allocation plan."""

    model_config = ConfigDict(extra="forbid")

    slot_s: Annotated[int, Field(ge=1, le=86_400)] = 300
    horizon_s: Annotated[int, Field(ge=60, le=14 * 86_400)] = 86_400
    # A tick's solve may take this long; None: slot_s / 60, within 2-60 s (5 s at the default
    # 300 s slot). The plan in force runs for a whole slot, so a longer slot affords a longer
    # solve, and the OR-Tools steps (LP, its roundings and seeded greedy rounds) only fit the
    # step budget from a few seconds up at hundreds of jobs (docs/allocation.md).
    solver_time_limit_s: Annotated[float | None, Field(gt=0, le=600)] = None
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
    # A running job's model is refitted from its new telemetry at most this often (0: at every
    # tick that has new samples for it). A job's first fit is not held back. A fit of up to 512
    # samples with a 30-minute half-life barely moves in a minute, and slot ticks are minutes
    # apart: the interval thins the refits of woken ticks (a submission burst wakes one about
    # every second), where at 1,000 jobs refits were a third of the tick's work beside the solve.
    model_refit_interval_s: Annotated[float, Field(ge=0, le=86_400)] = 60.0
    # At most this many refits a tick, the longest waiting first (a refit takes 8-12 ms: a
    # thousand running jobs refitted at every tick would outgrow the solve).
    model_refits_per_tick: Annotated[int, Field(ge=1, le=1_000_000)] = 64
    # Wakes (submissions, cancels, registrations, finished jobs) within this many seconds of
    # the last tick's start wait until then: a burst makes one tick, not one per request.
    wake_coalesce_s: Annotated[float, Field(ge=0, le=60)] = 1.0
    # The allocation policy the control loop and admission both use (names of POLICIES).
    policy: PolicyName = "greenflow"
    seed: int = 0
    # `greenflow serve` solves in a worker process: a solve of seconds then neither waits for
    # the API's threads (one GIL) nor stalls them. False: in the control loop's own thread.
    solver_process: bool = True

    def solve_limit_s(self) -> float:
        """Seconds one tick's solve may take."""
        if self.solver_time_limit_s is not None:
            return self.solver_time_limit_s
        return default_solver_time_limit_s(self.slot_s)

    def budget_check_s(self) -> float:
        """Seconds between the loop's intensity samples and budget checks."""
        if self.budget_check_interval_s is not None:
            return self.budget_check_interval_s
        return default_budget_check_s(self.slot_s)


class ClusterConfig(BaseModel):
    """Facts about the data centre that the energy arithmetic needs."""

    model_config = ConfigDict(extra="forbid")

    pue: Annotated[float, Field(ge=1.0, le=3.0)] = 1.2
    # The node model agents estimate with where nothing measures (labelled "estimated"): an
    # idle GPU's watts, and the host's (CPUs, memory, fans, disks) on nodes without RAPL.
    idle_power_per_gpu_w: Annotated[float, Field(ge=0, le=2000)] = 60.0
    host_power_w: Annotated[float, Field(ge=0, le=100_000)] = 150.0
    heartbeat_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    # How often agents heartbeat and report telemetry (told to them at registration).
    agent_heartbeat_interval_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    agent_telemetry_interval_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    # Telemetry is checked against these before it reaches the ledger: a sample may not claim
    # more than its GPUs at this power (busy GPU plus its share of the host), ...
    max_power_per_gpu_w: Annotated[float, Field(gt=0, le=10_000)] = 1500.0
    # ... nor a throughput more than this many times the job's prior model at its GPU count.
    telemetry_rate_factor: Annotated[float, Field(ge=1, le=10_000)] = 20.0
    # The agents' --checkpoint-dir is one shared storage every node reads. Only then does
    # placement move a running job to another node to keep a planned count (paused on its node,
    # checkpointed, resumed on the new one at that step); on node-local checkpoints the move
    # would restart it from an older checkpoint or step 0, so running jobs keep their node.
    checkpoints_shared: bool = False


EntrypointPattern = Annotated[
    str,
    Field(min_length=1, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*(:[A-Za-z0-9_*]+)?\*?$"),
]


class WorkloadConfig(BaseModel):
    """Which `module:function` entrypoints users may run (presets are always allowed).

    User code runs inside the job's worker processes on the node with the agent's rights, so
    the operator decides what may run: nothing beyond the presets unless listed. A pattern is a
    module (`mypkg` allows `mypkg:f` and `mypkg.sub:f`), or `module:function` exactly, or ends
    in `*` as a prefix."""

    model_config = ConfigDict(extra="forbid")

    allowed_entrypoints: list[EntrypointPattern] = []
    # Per queue, replacing the global list for that queue.
    queues: dict[str, list[EntrypointPattern]] = {}
    # Hours a workdir bundle is kept after its last use (upload, a job naming it, the finish of
    # the last job using it); then the leader's hourly sweep removes its bytes.
    bundle_retention_h: float = Field(default=168.0, gt=0, le=24 * 3650)

    def allows(self, entrypoint: str, queue: str) -> bool:
        """Whether users may run `entrypoint` on `queue`."""
        module = entrypoint.split(":", 1)[0]
        for pattern in self.queues.get(queue, self.allowed_entrypoints):
            if pattern.endswith("*"):
                if entrypoint.startswith(pattern[:-1]):
                    return True
            elif ":" in pattern:
                if entrypoint == pattern:
                    return True
            elif module == pattern or module.startswith(pattern + "."):
                return True
        return False


class GreenflowConfig(BaseModel):
    """The whole `greenflow.toml`."""

    model_config = ConfigDict(extra="forbid")

    budget: BudgetConfig = BudgetConfig()
    carbon: CarbonConfig = CarbonConfig()
    planner: PlannerConfig = PlannerConfig()
    cluster: ClusterConfig = ClusterConfig()
    workloads: WorkloadConfig = WorkloadConfig()

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
