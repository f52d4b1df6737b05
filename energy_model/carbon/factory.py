"""Build a carbon provider from configuration (the greenflow.toml [carbon] section)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from energy_model.carbon.base import CarbonProvider, Clock, HttpSettings, utc_now
from energy_model.carbon.carbon_aware_sdk import CarbonAwareSdkProvider
from energy_model.carbon.electricitymaps import ElectricityMapsProvider
from energy_model.carbon.errors import ProviderConfigError
from energy_model.carbon.resilient import MAX_FORECAST_AGE_S, ResilientCarbonSource
from energy_model.carbon.skill import PRIOR_QUANTILE, ForecastSkill
from energy_model.carbon.synthetic import SyntheticProvider
from energy_model.carbon.trace import ForecastMode, TraceProvider
from energy_model.carbon.uk import UkCarbonIntensityProvider
from energy_model.carbon.watttime import WattTimeProvider

ProviderName = Literal[
    "electricitymaps", "watttime", "uk", "carbon-aware-sdk", "trace", "synthetic"
]
PROVIDER_NAMES: tuple[str, ...] = get_args(ProviderName)

# Assumed when neither a provider answer nor a fresh cached forecast exists. Pessimistic on
# purpose (never assume a cleaner grid than known): above the yearly average of nearly every
# large grid; an operator on a coal-heavy grid should set a higher value for its region.
CONSERVATIVE_INTENSITY_G_PER_KWH = 700.0


def build_provider(
    name: str,
    *,
    region: str,
    api_key: str | None = None,
    base_url: str | None = None,
    trace_path: Path | None = None,
    clock_speedup: float = 1.0,
    forecast_mode: ForecastMode = "model",
    seed: int = 0,
    http: HttpSettings | None = None,
    clock: Clock = utc_now,
) -> CarbonProvider:
    """A provider by name; WattTime takes api_key as 'username:password'."""
    key = name.strip().lower().replace("_", "-")
    if key == "electricitymaps":
        return ElectricityMapsProvider(region, api_key, base_url, settings=http, clock=clock)
    if key == "watttime":
        username, _, password = (api_key or "").partition(":")
        return WattTimeProvider(region, username, password, base_url, settings=http, clock=clock)
    if key == "uk":
        return UkCarbonIntensityProvider(region or "national", base_url, settings=http, clock=clock)
    if key in ("carbon-aware-sdk", "carbonaware", "casdk"):
        return CarbonAwareSdkProvider(region, base_url, api_key, settings=http, clock=clock)
    if key == "trace":
        if trace_path is None:
            raise ProviderConfigError("trace", "trace_path is required for the trace provider")
        return TraceProvider.from_file(
            Path(trace_path),
            region=region or "trace",
            clock_speedup=clock_speedup,
            forecast_mode=forecast_mode,
            clock=clock,
        )
    if key == "synthetic":
        return SyntheticProvider(
            region=region or "synthetic",
            seed=seed,
            clock_speedup=clock_speedup,
            forecast_mode=forecast_mode,
            clock=clock,
        )
    raise ProviderConfigError(
        name, f"unknown carbon provider {name!r}; choose one of {', '.join(PROVIDER_NAMES)}"
    )


class CarbonConfig(BaseModel):
    """The [carbon] section of greenflow.toml: where intensity comes from, what to assume without it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    provider: ProviderName = "synthetic"
    region: str = "local"
    api_key_env: str | None = None  # name of the environment variable that holds the key
    base_url: str | None = None
    trace_path: Path | None = None
    # Trace and synthetic providers replay this many trace seconds per wall-clock second.
    clock_speedup: Annotated[float, Field(gt=0)] = 1.0
    # Trace/synthetic providers: "model" forecasts from the replayed past (as a real provider
    # would); "oracle" reveals the trace's own future (a perfect forecast, for experiments).
    forecast_mode: ForecastMode = "model"
    seed: int = 0
    conservative_intensity_g_per_kwh: Annotated[float, Field(gt=0)] = (
        CONSERVATIVE_INTENSITY_G_PER_KWH
    )
    max_forecast_age_s: Annotated[float, Field(gt=0)] = MAX_FORECAST_AGE_S
    # Blend a provider's own forecast with ours by the skill each has shown per horizon hour.
    blend_forecasts: bool = True
    # The quantile of intensity per slot a hard budget plans with (from the measured error of
    # the forecasts handed out; 0.5 plans with the forecast itself).
    forecast_quantile: Annotated[float, Field(ge=0.5, lt=1.0)] = PRIOR_QUANTILE


def build_source(config: CarbonConfig, clock: Clock = utc_now) -> ResilientCarbonSource:
    """The configured provider wrapped in the failure policy."""
    api_key = os.environ.get(config.api_key_env) if config.api_key_env else None
    if config.api_key_env and not api_key and config.provider in ("electricitymaps", "watttime"):
        raise ProviderConfigError(
            config.provider, f"environment variable {config.api_key_env} is not set"
        )
    provider = build_provider(
        config.provider,
        region=config.region,
        api_key=api_key,
        base_url=config.base_url,
        trace_path=config.trace_path,
        clock_speedup=config.clock_speedup,
        forecast_mode=config.forecast_mode,
        seed=config.seed,
        clock=clock,
    )
    return ResilientCarbonSource(
        provider,
        conservative_intensity_g_per_kwh=config.conservative_intensity_g_per_kwh,
        max_forecast_age_s=config.max_forecast_age_s,
        clock=clock,
        skill=ForecastSkill(quantile=config.forecast_quantile),
        blend=config.blend_forecasts,
    )
