"""create_app(): routers, middleware, error handlers and the database of one scheduler process."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from pydantic import BaseModel
from sqlalchemy import text
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler_service.admission import Admission
from scheduler_service.auth.cache import TokenCache
from scheduler_service.auth.throttle import FailureThrottle
from scheduler_service.budget.metrics import BudgetCollector
from scheduler_service.budget.router import router as budget_router
from scheduler_service.bundles.router import BUNDLES_PREFIX
from scheduler_service.bundles.router import router as bundles_router
from scheduler_service.carbon.router import router as carbon_router
from scheduler_service.cluster.router import router as cluster_router
from scheduler_service.console.router import mount_console
from scheduler_service.control_loop import ControlLoop
from scheduler_service.db.session import make_engine, make_session_factory
from scheduler_service.deps import reject_unknown_query_params
from scheduler_service.dispatch.router import router as plan_router
from scheduler_service.errors import (
    DatabaseWatch,
    database_unavailable_response,
    install_error_handlers,
    is_database_down,
)
from scheduler_service.input_guard import InputGuard, SecurityHeaders
from scheduler_service.jobs.router import router as jobs_router
from scheduler_service.metrics import make_registry
from scheduler_service.nodes.router import router as nodes_router
from scheduler_service.nodes.secrets import load_node_secrets
from scheduler_service.reload import reload_on_signal
from scheduler_service.reload import router as reload_router
from scheduler_service.settings import GreenflowConfig, Settings
from scheduler_service.telemetry.router import router as telemetry_router
from scheduler_service.telemetry.service import RejectionLog


class RequestCounter:
    """Counts answered requests by method, route and status (plain ASGI: no task per request)."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on and count its answer once it is sent."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, send_noting_status)
        # The router leaves the matched route in the scope: count by its template, not the URL.
        path = getattr(scope.get("route"), "path", "unmatched")
        self.counter.labels(scope["method"], path, str(status)).inc()


class Health(BaseModel):
    """Readiness: the process answers and the database is reachable."""

    status: str
    database: str


class Liveness(BaseModel):
    """The process answers (whatever the database does)."""

    status: str


@dataclass(frozen=True)
class AgentTiming:
    """How often agents heartbeat and report (told to them at registration)."""

    heartbeat_interval_s: float
    telemetry_interval_s: float


def _install_sighup(app: FastAPI) -> bool:
    """Reload greenflow.toml on SIGHUP, where this event loop may handle signals (the main
    thread of `greenflow serve`; not under a test client's thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_on_signal, app)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


def create_app(settings: Settings, config: GreenflowConfig) -> FastAPI:
    """Build the scheduler's ASGI app for these settings and this config."""
    engine = make_engine(settings.database_url)
    session_factory = make_session_factory(engine)
    node_secrets = load_node_secrets(settings)
    loop: ControlLoop | None = (
        ControlLoop(
            config,
            session_factory,
            engine,
            node_secrets=node_secrets,
            solver_process=config.planner.solver_process,
        )
        if settings.run_control_loop
        else None
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(loop.run(), name="greenflow-control-loop") if loop else None
        hangup = _install_sighup(app)
        try:
            yield
        finally:
            if hangup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            if loop is not None and task is not None:
                await loop.stop()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            engine.dispose()

    app = FastAPI(
        lifespan=lifespan,
        title="GreenFlow scheduler",
        version="0.1.0",
        description="Carbon-aware scheduling of elastic deep-learning training jobs.",
        dependencies=[Depends(reject_unknown_query_params)],
        # /docs is served below from local assets; FastAPI's own pages load them from a CDN.
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.config = config
    app.state.engine = engine
    app.state.session_factory = session_factory
    app.state.control_loop = loop
    app.state.node_secrets = node_secrets
    app.state.database_watch = DatabaseWatch()
    app.state.auth_throttle = FailureThrottle(free=settings.auth_failures_free)
    app.state.token_cache = TokenCache(settings.auth_cache_s)
    app.state.wake_control_loop = loop.wake if loop is not None else (lambda: None)
    # One admission per process: its checks queue behind one lock, against the loop's plan.
    app.state.admission = (
        Admission(config, lambda: loop.previous, loop.models)
        if loop is not None
        else Admission(config)
    )
    app.state.agent_timing = AgentTiming(
        config.cluster.agent_heartbeat_interval_s, config.cluster.agent_telemetry_interval_s
    )
    registry, requests_total = make_registry(app.state.session_factory, loop)
    registry.register(BudgetCollector(app.state.session_factory, lambda: app.state.config))
    app.state.metrics_registry = registry
    app.state.telemetry_rejected = Counter(
        "greenflow_telemetry_samples_rejected",
        "Telemetry samples refused (not the job's node or generation, or beyond its GPUs)",
        ["reason"],
        registry=registry,
    )
    app.state.telemetry_rejection_log = RejectionLog()

    app.add_middleware(RequestCounter, counter=requests_total)
    install_error_handlers(app)
    app.add_middleware(
        InputGuard,
        max_body_bytes=settings.max_body_bytes,
        large_bodies={BUNDLES_PREFIX: settings.max_bundle_bytes},
    )
    app.add_middleware(SecurityHeaders)  # outermost: on every answer, the guard's included
    app.include_router(jobs_router)
    app.include_router(bundles_router)
    app.include_router(cluster_router)
    app.include_router(nodes_router)
    app.include_router(telemetry_router)
    app.include_router(carbon_router)
    app.include_router(budget_router)
    app.include_router(reload_router)
    app.include_router(plan_router)
    mount_console(app)

    @app.get(
        "/healthz",
        tags=["ops"],
        response_model=Health,
        responses={503: {"description": "The database is unavailable (see Retry-After)."}},
    )
    def healthz() -> Response | Health:
        """Readiness: 200 while the database answers, 503 while it does not."""
        try:
            with session_factory() as session:
                session.execute(text("SELECT 1"))
        except Exception as exc:
            if not is_database_down(exc):
                raise
            app.state.database_watch.down(exc)
            return database_unavailable_response()
        app.state.database_watch.up()
        return Health(status="ok", database="ok")

    @app.get("/livez", tags=["ops"])
    def livez() -> Liveness:
        """Liveness: 200 while the process serves requests, database or not (restart on failure)."""
        return Liveness(status="ok")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        """Swagger UI for /openapi.json, its files served by this process (no CDN)."""
        vendor = "/console/static/vendor"
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - API",
            swagger_js_url=f"{vendor}/swagger-ui-bundle.js",
            swagger_css_url=f"{vendor}/swagger-ui.css",
            swagger_favicon_url=f"{vendor}/swagger-favicon-32x32.png",
        )

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def metrics() -> Response:
        """Prometheus metrics in the text exposition format."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
