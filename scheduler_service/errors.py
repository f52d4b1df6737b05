"""One handler for every GreenflowError, plus the framework's own errors (405, stale rows)."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm.exc import StaleDataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from scheduler_service.exceptions import GreenflowError

log = logging.getLogger("greenflow.database")

# How long a client should wait before trying again while the database is away.
RETRY_AFTER_S = 5
# Errors that mean "the database cannot be reached now", not "this request is wrong".
DATABASE_DOWN_ERRORS: tuple[type[Exception], ...] = (
    OperationalError,
    InterfaceError,
    PoolTimeoutError,
)


class DatabaseWatch:
    """Notices when the database goes away and comes back: one log line each, not one per call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._refused = 0

    @property
    def is_down(self) -> bool:
        """Whether the last database call failed."""
        return self._down_since is not None

    def down(self, exc: BaseException) -> None:
        """A call failed for want of the database."""
        with self._lock:
            self._refused += 1
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
        first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        log.error(
            "database unavailable (%s: %s); answering 503 until it is back",
            type(exc).__name__,
            first[0] if first else "no detail",
        )

    def up(self) -> None:
        """A database call succeeded."""
        if self._down_since is None:  # the common case: no lock
            return
        with self._lock:
            if self._down_since is None:
                return
            lasted_s = time.monotonic() - self._down_since
            refused, self._down_since, self._refused = self._refused, None, 0
        log.warning(
            "database available again after %.1f s (%d requests answered 503 meanwhile)",
            lasted_s,
            refused,
        )


def database_unavailable_response() -> JSONResponse:
    """503 naming the database, with the time to wait."""
    return JSONResponse(
        {"detail": "the database is unavailable; retry later", "database": "unavailable"},
        status_code=503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def is_database_down(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot be reached (not that a statement was wrong)."""
    if isinstance(exc, DATABASE_DOWN_ERRORS):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def _serialisable(value: Any) -> Any:
    """A validation error's echoed input made safe for JSON (non-finite numbers and values
    the encoder cannot handle become text), so answering a bad request can never fail."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(_serialisable(k)): _serialisable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_serialisable(v) for v in value]
    return _serialisable(str(value))


def _detail(status_code: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status_code, content={"detail": message})


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Register the mapping from domain errors to 4xx responses."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            # Starlette lists only the first matching route's methods; list every route's.
            allow = ", ".join(_allowed_methods(app, request))
            return JSONResponse({"detail": exc.detail}, status_code=405, headers={"Allow": allow})
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": _serialisable(exc.errors())})

    async def _database(_: Request, exc: Exception) -> Response:
        if not is_database_down(exc):
            raise exc  # a real bug: the server error handler logs it once
        app.state.database_watch.down(exc)
        return database_unavailable_response()

    for kind in (*DATABASE_DOWN_ERRORS, DBAPIError):
        app.add_exception_handler(kind, _database)

    @app.exception_handler(StaleDataError)
    async def _stale(_: Request, exc: StaleDataError) -> JSONResponse:
        return _detail(
            409, "the job changed while this request ran (the scheduler updated it); retry"
        )

    @app.exception_handler(GreenflowError)
    async def _greenflow(_: Request, exc: GreenflowError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())
