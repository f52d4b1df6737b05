"""create_app(): routers, middleware, error handlers and the database of one scheduler process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sqlalchemy import text

from scheduler_service.budget.router import router as budget_router
from scheduler_service.carbon.router import router as carbon_router
from scheduler_service.cluster.router import router as cluster_router
from scheduler_service.console.router import mount_console
from scheduler_service.control_loop import ControlLoop
from scheduler_service.db.session import make_engine, make_session_factory
from scheduler_service.deps import SessionDep, reject_unknown_query_params
from scheduler_service.dispatch.router import router as plan_router
from scheduler_service.errors import install_error_handlers
from scheduler_service.jobs.router import router as jobs_router
from scheduler_service.metrics import make_registry
from scheduler_service.nodes.router import router as nodes_router
from scheduler_service.settings import GreenflowConfig, Settings
from scheduler_service.telemetry.router import router as telemetry_router


class Health(BaseModel):
    """Liveness and database reachability."""

    status: str
    database: str


@dataclass(frozen=True)
class AgentTiming:
    """How often agents heartbeat and report (told to them at registration)."""

    heartbeat_interval_s: float
    telemetry_interval_s: float


def create_app(settings: Settings, config: GreenflowConfig) -> FastAPI:
    """Build the scheduler's ASGI app for these settings and this config."""
    engine = make_engine(settings.database_url)
    session_factory = make_session_factory(engine)
    loop: ControlLoop | None = (
        ControlLoop(config, session_factory, engine) if settings.run_control_loop else None
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(loop.run(), name="greenflow-control-loop") if loop else None
        try:
            yield
        finally:
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
    )
    app.state.settings = settings
    app.state.config = config
    app.state.engine = engine
    app.state.session_factory = session_factory
    app.state.control_loop = loop
    app.state.wake_control_loop = loop.wake if loop is not None else (lambda: None)
    app.state.agent_timing = AgentTiming(
        config.cluster.agent_heartbeat_interval_s, config.cluster.agent_telemetry_interval_s
    )
    registry, requests_total = make_registry(app.state.session_factory, loop)
    app.state.metrics_registry = registry

    @app.middleware("http")
    async def count_requests(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        requests_total.labels(request.method, path, str(response.status_code)).inc()
        return response

    install_error_handlers(app)
    app.include_router(jobs_router)
    app.include_router(cluster_router)
    app.include_router(nodes_router)
    app.include_router(telemetry_router)
    app.include_router(carbon_router)
    app.include_router(budget_router)
    app.include_router(plan_router)
    mount_console(app)

    @app.get("/healthz", tags=["ops"])
    def healthz(session: SessionDep) -> Health:
        """Liveness: the process answers and the database is reachable."""
        session.execute(text("SELECT 1"))
        return Health(status="ok", database="ok")

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def metrics() -> Response:
        """Prometheus metrics in the text exposition format."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
