"""Typed errors of carbon providers; each says which provider and what failed."""

from __future__ import annotations


class CarbonProviderError(Exception):
    """A carbon provider could not deliver data."""

    def __init__(self, provider: str, message: str, status_code: int | None = None) -> None:
        self.provider = provider
        self.status_code = status_code
        status = f" (HTTP {status_code})" if status_code is not None else ""
        super().__init__(f"{provider}: {message}{status}")


class ProviderConfigError(CarbonProviderError):
    """The provider is misconfigured (missing key, region or file); fix the [carbon] config."""


class ProviderAuthError(CarbonProviderError):
    """The credentials were refused or lack access to this endpoint or region."""


class ProviderRequestError(CarbonProviderError):
    """The provider rejected the request (unknown region, bad parameter)."""


class ProviderRateLimited(CarbonProviderError):
    """Too many requests; `retry_after_s` says when to try again when the provider told us."""

    def __init__(
        self,
        provider: str,
        message: str,
        status_code: int | None = 429,
        retry_after_s: float | None = None,
    ) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(provider, message, status_code)


class ProviderUnavailable(CarbonProviderError):
    """The provider timed out, refused the connection or answered with a server error."""


class ProviderBadResponse(CarbonProviderError):
    """The response was not in the documented shape (HTML error page, missing fields)."""


class ProviderNoData(CarbonProviderError):
    """The provider answered but has no data (or no forecast) for this region and time."""
