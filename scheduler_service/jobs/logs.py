"""A job's output: kept by the agent of the node it ran on, fetched from it on demand.

The scheduler stores none of it: it finds the job's node (its newest command that went to one)
and asks that agent (`GET /jobs/{id}/logs`, with the node's secret) for a piece of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import httpx
from sqlalchemy.orm import Session

from scheduler_service.auth.service import Principal
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.exceptions import GreenflowError
from scheduler_service.jobs.service import get_visible_job
from scheduler_service.nodes.repository import NodeRepository
from scheduler_service.nodes.secrets import NodeSecrets
from worker_agent.protocol import AGENT_SECRET_HEADER, JobLogChunk, JobScalarCurve

LogStream = Literal["output", "scalars"]
AGENT_TIMEOUT_S = 10.0


class LogsUnavailable(GreenflowError):
    """The node that holds the job's output does not answer now."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 503)


@dataclass(frozen=True)
class LogSource:
    """Where a job's output is: its node and how to ask that node's agent."""

    node: str
    agent_url: str
    secret: str


def log_source(
    session: Session, principal: Principal, job_id: int, node_secrets: NodeSecrets
) -> LogSource | None:
    """The agent holding a visible job's output; None if the job never went to a node."""
    get_visible_job(session, principal, job_id)
    allocation = AllocationRepository(session).latest_with_node(job_id)
    if allocation is None or allocation.node_id is None:
        return None
    node = NodeRepository(session).get(allocation.node_id)
    if node is None or not node.agent_secret_nonce:
        return None
    secret = node_secrets.agent_secret(node.id, node.name, node.agent_secret_nonce)
    return LogSource(node.name, node.agent_url, secret)


def fetch_chunk(
    source: LogSource | None,
    job_id: int,
    *,
    rank: int,
    stream: LogStream,
    offset: int,
    limit: int,
    tail: int | None = None,
) -> JobLogChunk:
    """A piece of the job's output from its agent (empty when it never ran anywhere); with
    `tail`, its newest `tail` bytes."""
    if source is None:
        return JobLogChunk(
            job_id=job_id, rank=rank, stream=stream, offset=offset, next_offset=offset
        )
    params: dict[str, str | int] = {
        "rank": rank,
        "stream": stream,
        "offset": offset,
        "limit": limit,
    }
    if tail is not None:
        params["tail"] = tail
    chunk = JobLogChunk.model_validate_json(_ask_agent(source, job_id, "logs", params))
    return chunk.model_copy(update={"node": source.node})


def fetch_curve(source: LogSource | None, job_id: int, *, max_points: int) -> JobScalarCurve:
    """The job's logged scalars per step from its agent (empty when it never ran anywhere)."""
    if source is None:
        return JobScalarCurve(job_id=job_id)
    body = _ask_agent(source, job_id, "curve", {"max_points": max_points})
    curve = JobScalarCurve.model_validate_json(body)
    return curve.model_copy(update={"node": source.node})


def _ask_agent(source: LogSource, job_id: int, what: str, params: dict[str, str | int]) -> bytes:
    """GET /jobs/{id}/{what} on the job's agent; LogsUnavailable when it does not answer."""
    try:
        response = httpx.get(
            f"{source.agent_url.rstrip('/')}/jobs/{job_id}/{what}",
            params=params,
            headers={AGENT_SECRET_HEADER: source.secret},
            timeout=AGENT_TIMEOUT_S,
        )
    except httpx.HTTPError as exc:
        raise LogsUnavailable(
            f"node {source.node} holds job {job_id}'s output and does not answer: {exc}"
        ) from exc
    if response.status_code != 200:
        raise LogsUnavailable(
            f"node {source.node} refused job {job_id}'s output: HTTP {response.status_code}"
        )
    return response.content
