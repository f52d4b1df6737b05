"""Domain errors mapped to HTTP answers that name the problem."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse
from sqlalchemy.orm.exc import StaleDataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from scheduler_service.exceptions import FieldError, NotAllowed
from scheduler_service.jobs.service import JobNotFound, SubmissionConflict
from scheduler_service.jobs.states import InvalidTransition


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

    @app.exception_handler(StaleDataError)
    async def _stale(_: Request, exc: StaleDataError) -> JSONResponse:
        return _detail(
            409, "the job changed while this request ran (the scheduler updated it); retry"
        )

    @app.exception_handler(JobNotFound)
    async def _not_found(_: Request, exc: JobNotFound) -> JSONResponse:
        return _detail(404, str(exc))

    @app.exception_handler(SubmissionConflict)
    async def _conflict(_: Request, exc: SubmissionConflict) -> JSONResponse:
        return _detail(409, str(exc))

    @app.exception_handler(InvalidTransition)
    async def _bad_transition(_: Request, exc: InvalidTransition) -> JSONResponse:
        return _detail(409, str(exc))

    @app.exception_handler(NotAllowed)
    async def _forbidden(_: Request, exc: NotAllowed) -> JSONResponse:
        return _detail(403, str(exc))

    @app.exception_handler(FieldError)
    async def _field(_: Request, exc: FieldError) -> JSONResponse:
        body = {"detail": [{"loc": ["body", exc.field], "msg": exc.message, "type": "value_error"}]}
        return JSONResponse(status_code=422, content=body)
