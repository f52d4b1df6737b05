"""Carbon-intensity providers, forecasts and the failure policy."""

from energy_model.carbon.base import CarbonProvider, HttpSettings
from energy_model.carbon.errors import (
    CarbonProviderError,
    ProviderAuthError,
    ProviderBadResponse,
    ProviderConfigError,
    ProviderNoData,
    ProviderRateLimited,
    ProviderRequestError,
    ProviderUnavailable,
)
from energy_model.carbon.factory import PROVIDER_NAMES, CarbonConfig, build_provider, build_source
from energy_model.carbon.forecast import CarbonForecast, ForecastPoint, PointKind, Signal
from energy_model.carbon.resilient import ResilientCarbonSource
from energy_model.carbon.series import IntensitySeries, load_intensity_csv

__all__ = [
    "PROVIDER_NAMES",
    "CarbonConfig",
    "CarbonForecast",
    "CarbonProvider",
    "CarbonProviderError",
    "ForecastPoint",
    "HttpSettings",
    "IntensitySeries",
    "PointKind",
    "ProviderAuthError",
    "ProviderBadResponse",
    "ProviderConfigError",
    "ProviderNoData",
    "ProviderRateLimited",
    "ProviderRequestError",
    "ProviderUnavailable",
    "ResilientCarbonSource",
    "Signal",
    "build_provider",
    "build_source",
    "load_intensity_csv",
]
