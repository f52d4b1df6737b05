"""The agent's HTTP API (scheduler -> agent) and its server.

Every route but `GET /healthz` needs the per-node secret the scheduler drew at the agent's
latest registration.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse

from worker_agent.agent import Agent, AgentConfig
from worker_agent.errors import AgentError
from worker_agent.logstore import MAX_CHUNK_BYTES
from worker_agent.protocol import (
    AGENT_SECRET_HEADER,
    MAX_CURVE_POINTS,
    MAX_SLOTS,
    AgentStatus,
    AllocationAck,
    AllocationCommand,
    JobLogChunk,
    JobScalarCurve,
    RunningJob,
    StopCommand,
)
from worker_agent.telemetry import NvmlMeter

log = logging.getLogger("greenflow.agent")


def create_app(agent: Agent) -> FastAPI:
    """The agent's FastAPI app (every route but /healthz needs the agent secret)."""

    app = FastAPI(title="GreenFlow agent")

    def require_secret(
        secret: Annotated[str | None, Header(alias=AGENT_SECRET_HEADER)] = None,
    ) -> None:
        if secret is None or not secrets.compare_digest(
            secret.encode(), agent.config.secret.encode()
        ):
            raise HTTPException(401, f"missing or wrong {AGENT_SECRET_HEADER} header")

    Authorized = Depends(require_secret)

    @app.exception_handler(AgentError)
    async def agent_error(request: Request, exc: AgentError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status_code)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Liveness (no secret needed)."""
        return {"status": "ok", "name": agent.config.name}

    @app.get("/status", dependencies=[Authorized])
    def status() -> AgentStatus:
        """Every job this agent runs."""
        return agent.status()

    @app.post("/jobs/{job_id}/allocation", dependencies=[Authorized])
    def allocation(job_id: int, cmd: AllocationCommand) -> AllocationAck:
        """Apply an allocation: start, hot-switch, pause (0 slots) or resume a job."""
        if cmd.job_id != job_id:
            raise HTTPException(422, f"body job_id {cmd.job_id} differs from path job_id {job_id}")
        return agent.apply_allocation(cmd)

    @app.get("/jobs/{job_id}/logs", dependencies=[Authorized])
    def logs(
        job_id: Annotated[int, Path(ge=1, le=2**62)],
        rank: Annotated[int, Query(ge=0, le=MAX_SLOTS)] = 0,
        stream: Literal["output", "scalars"] = "output",
        offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_CHUNK_BYTES)] = MAX_CHUNK_BYTES,
        tail: Annotated[int | None, Query(ge=1, le=MAX_CHUNK_BYTES)] = None,
    ) -> JobLogChunk:
        """A piece of a job worker's captured stdout/stderr (or scalars), by rank; `tail`: the
        newest bytes instead of those from `offset`."""
        return agent.job_logs(job_id, rank, stream, offset, limit, tail)

    @app.get("/jobs/{job_id}/curve", dependencies=[Authorized])
    def curve(
        job_id: Annotated[int, Path(ge=1, le=2**62)],
        max_points: Annotated[int, Query(ge=2, le=MAX_CURVE_POINTS)] = MAX_CURVE_POINTS,
    ) -> JobScalarCurve:
        """The job's `greenflow_log` scalars, each name's mean per step over all its workers."""
        return agent.job_curve(job_id, max_points)

    @app.post("/jobs/{job_id}/stop", dependencies=[Authorized])
    def stop(job_id: int, cmd: StopCommand) -> RunningJob:
        """Stop a job for good and free its slots."""
        if cmd.job_id != job_id:
            raise HTTPException(422, f"body job_id {cmd.job_id} differs from path job_id {job_id}")
        return agent.stop_job(cmd)

    return app


# ----- serving --------------------------------------------------------------------------------
class _AgentServer(uvicorn.Server):
    """uvicorn server that exits cleanly on SIGINT/SIGTERM instead of re-raising the signal."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


@contextlib.contextmanager
def bound_socket(host: str, port: int) -> Iterator[socket.socket]:
    """A listening TCP socket (port 0 = a free port chosen by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
        sock.set_inheritable(True)
        yield sock
    finally:
        sock.close()


def reachable_url(host: str, port: int) -> str:
    """The URL others reach this agent at when it listens on host:port."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def serve(
    config: AgentConfig,
    nvml: NvmlMeter | None = None,
) -> str | None:
    """Run the agent until SIGINT/SIGTERM, then stop every job's workers.

    Returns None, or why the agent stopped on its own (the scheduler refused its registration).
    """
    with bound_socket(config.host, config.port) as sock:
        port = int(sock.getsockname()[1])
        agent = Agent(config, nvml)
        agent.link.agent_url = config.advertise_url or reachable_url(config.host, port)
        app = create_app(agent)
        server = _AgentServer(
            uvicorn.Config(
                app,
                log_level="warning",
                timeout_graceful_shutdown=30,
                lifespan="on",
            )
        )
        log.info("agent %s listening on %s", config.name, agent.link.agent_url)
        agent.link.on_fatal = lambda: setattr(server, "should_exit", True)
        agent.start_background()
        try:
            server.run(sockets=[sock])
        finally:
            log.info("shutting down: stopping every job's workers")
            agent.shutdown()
            log.info("agent %s stopped", config.name)
        return agent.link.fatal_error
