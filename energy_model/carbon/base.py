"""The provider protocol and the shared async HTTP plumbing (timeouts, retries, typed errors)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from energy_model.carbon.errors import (
    CarbonProviderError,
    ProviderAuthError,
    ProviderBadResponse,
    ProviderNoData,
    ProviderRateLimited,
    ProviderRequestError,
    ProviderUnavailable,
)
from energy_model.carbon.forecast import CarbonForecast

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


@runtime_checkable
class CarbonProvider(Protocol):
    """Anything that returns the current intensity and a forecast for one region."""

    name: str
    region: str

    async def get_forecast(self, horizon_s: int) -> CarbonForecast:
        """Intensity now (first point) and over the next `horizon_s` seconds."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


@dataclass(frozen=True)
class HttpSettings:
    """Timeouts and retry policy of one HTTP provider."""

    timeout_s: float = 10.0
    attempts: int = 3  # total tries of a request that failed transiently (timeout, 5xx, 429)
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 8.0
    max_retry_after_s: float = 30.0  # never sleep longer than this on a 429 Retry-After


def _snippet(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "…"


def _error_message(response: httpx.Response) -> str:
    """The most useful message in an error body, whatever its shape (JSON or HTML)."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _snippet(response.text) or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):  # UK: {"error": {"code", "message"}}
            return str(err.get("message") or err.get("code"))
        parts = [str(body[k]) for k in ("error", "title", "message", "detail") if body.get(k)]
        if isinstance(body.get("errors"), dict):  # RFC 7807 validation problem
            parts += [f"{k}: {'; '.join(map(str, v))}" for k, v in body["errors"].items()]
        if parts:
            return " — ".join(parts)
    return _snippet(response.text)


class HttpProvider:
    """Base of the HTTP clients: one AsyncClient, typed errors, tenacity retries."""

    name = "http"

    def __init__(
        self,
        base_url: str,
        region: str,
        settings: HttpSettings | None = None,
        headers: Mapping[str, str] | None = None,
        clock: Clock = utc_now,
    ) -> None:
        self.region = region
        self.settings = settings or HttpSettings()
        self.clock = clock
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=self.settings.timeout_s,
            headers={"Accept": "application/json", **(headers or {})},
        )

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        await self._client.aclose()

    async def _send_once(
        self,
        path: str,
        params: Mapping[str, Any] | None,
        headers: Mapping[str, str] | None,
        auth: httpx.Auth | tuple[str, str] | None,
    ) -> httpx.Response:
        try:
            response = await self._client.get(
                path,
                params=params,
                headers=headers,
                auth=auth,  # type: ignore[arg-type]
            )
        except httpx.TimeoutException as exc:
            raise ProviderUnavailable(
                self.name, f"GET {path} timed out after {self.settings.timeout_s:g} s"
            ) from exc
        except httpx.TransportError as exc:
            raise ProviderUnavailable(
                self.name, f"GET {path} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if response.status_code == 429:
            retry_after = response.headers.get("Retry-After")
            try:
                retry_after_s = float(retry_after) if retry_after else None
            except ValueError:
                retry_after_s = None
            raise ProviderRateLimited(
                self.name,
                f"GET {path} rate limited: {_error_message(response)}",
                retry_after_s=retry_after_s,
            )
        # 501 Not Implemented is permanent (e.g. a source without forecasts): not retried.
        if response.status_code >= 500 and response.status_code != 501:
            raise ProviderUnavailable(
                self.name,
                f"GET {path} server error: {_error_message(response)}",
                response.status_code,
            )
        return response

    async def get(
        self,
        path: str,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        auth: httpx.Auth | tuple[str, str] | None = None,
    ) -> httpx.Response:
        """GET with retries on timeouts, 5xx and 429; other errors raise typed at once."""
        s = self.settings
        base_wait = wait_exponential(multiplier=s.backoff_initial_s, max=s.backoff_max_s)

        def wait(state: Any) -> float:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, ProviderRateLimited) and exc.retry_after_s is not None:
                return min(exc.retry_after_s, s.max_retry_after_s)
            return float(base_wait(state))

        retrying = AsyncRetrying(
            stop=stop_after_attempt(s.attempts),
            wait=wait,
            retry=retry_if_exception_type((ProviderUnavailable, ProviderRateLimited)),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                response = await self._send_once(path, params, headers, auth)
        return response

    def raise_for_status(self, response: httpx.Response, what: str) -> None:
        """Map a 4xx answer to a typed error that says what failed."""
        code = response.status_code
        if code < 400:
            return
        message = f"{what}: {_error_message(response)}"
        if code in (401, 403):
            raise ProviderAuthError(self.name, message, code)
        if code == 404:
            raise ProviderNoData(self.name, message, code)
        raise ProviderRequestError(self.name, message, code)

    def json_body(self, response: httpx.Response, what: str) -> Any:
        """The JSON body of a successful response, or ProviderBadResponse naming what was wrong."""
        self.raise_for_status(response, what)
        if response.status_code == 204 or not response.content:
            raise ProviderNoData(self.name, f"{what}: no data (HTTP {response.status_code})")
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            ctype = response.headers.get("content-type", "?")
            raise ProviderBadResponse(
                self.name,
                f"{what}: expected JSON, got {ctype}: {_snippet(response.text)}",
                response.status_code,
            ) from exc

    def bad_shape(self, what: str, exc: Exception) -> CarbonProviderError:
        """A ProviderBadResponse for a body that parsed but lacks documented fields."""
        return ProviderBadResponse(self.name, f"{what}: unexpected response shape: {exc}")


def parse_utc(text: str) -> datetime:
    """Parse an ISO 8601 timestamp (with Z, offsets or none) as aware UTC."""
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
