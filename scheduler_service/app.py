"""create_app(): routers, middleware, error handlers and the database of one scheduler process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sqlalchemy import text

from scheduler_service.cluster.router import router as cluster_router
from scheduler_service.console.router import mount_console
from scheduler_service.db.session import make_engine, make_session_factory
from scheduler_service.deps import SessionDep, reject_unknown_query_params
from scheduler_service.errors import install_error_handlers
from scheduler_service.jobs.router import router as jobs_router
from scheduler_service.metrics import make_registry
from scheduler_service.settings import GreenflowConfig, Settings


class Health(BaseModel):
    """Liveness and database reachability."""

    status: str
    database: str


def create_app(settings: Settings, config: GreenflowConfig) -> FastAPI:
    """Build the scheduler's ASGI app for these settings and this config."""
    engine = make_engine(settings.database_url)
    app = FastAPI(
        title="GreenFlow scheduler",
        version="0.1.0",
        description="Carbon-aware scheduling of elastic deep-learning training jobs.",
        dependencies=[Depends(reject_unknown_query_params)],
    )
    app.state.settings = settings
    app.state.config = config
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    registry, requests_total = make_registry(app.state.session_factory)
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
