"""A small HTTP client for the CLI's user commands."""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(Exception):
    """The server refused a request; `status` is the HTTP code, the message its explanation."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _explain(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    if isinstance(detail, list):
        parts = []
        for err in detail:
            loc = ".".join(str(p) for p in err.get("loc", []) if p != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return "; ".join(parts)
    return str(detail)


class GreenflowClient:
    """Calls the scheduler's REST API with a bearer token."""

    def __init__(self, base_url: str, token: str | None, timeout_s: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send a request and return the decoded JSON, or raise ApiError."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(
                0, f"cannot reach the scheduler at {self._http.base_url}: {exc}"
            ) from exc
        if response.status_code >= 400:
            raise ApiError(response.status_code, _explain(response))
        return response.json() if response.content else None

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()
