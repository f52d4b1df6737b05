"""Calls from the scheduler to worker agents, with retries for transient failures."""

from __future__ import annotations

import httpx
from pydantic import BaseModel
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from worker_agent.protocol import AGENT_SECRET_HEADER, AllocationAck, AllocationCommand, StopCommand


class AgentRejected(Exception):
    """The agent refused the command (e.g. a stale generation); retrying will not help."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"agent answered {status}: {detail}")
        self.status = status


class AgentUnreachable(Exception):
    """The agent did not answer after retries."""


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code >= 500


class AgentClient:
    """One async HTTP client for all agents."""

    def __init__(
        self, timeout_s: float = 120.0, attempts: int = 3, max_connections: int = 100
    ) -> None:
        # Long timeout: an allocation returns when the hot switch is done.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=max_connections),
        )
        self.attempts = attempts

    async def _post(self, url: str, secret: str, body: BaseModel) -> httpx.Response:
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self.attempts),
                wait=wait_exponential(multiplier=0.5, max=5),
                retry=retry_if_exception(_transient),
                reraise=True,
            ):
                with attempt:
                    response = await self._http.post(
                        url,
                        content=body.model_dump_json(),
                        headers={AGENT_SECRET_HEADER: secret, "content-type": "application/json"},
                    )
                    if response.status_code >= 500:
                        response.raise_for_status()
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            raise AgentUnreachable(f"{url}: {exc}") from exc
        except Exception as exc:
            # A node whose address or secret cannot even make a request (a malformed URL, say)
            # is that node's problem: it must never fail the tick that serves every other node.
            raise AgentUnreachable(f"{url}: cannot send: {type(exc).__name__}: {exc}") from exc
        if response.status_code in (401, 403):
            # The agent registered again (a new secret) after this command was prepared: the
            # next delivery carries the new one.
            raise AgentUnreachable(f"{url}: the agent refused the secret ({response.status_code})")
        if response.status_code >= 400:
            try:
                detail = str(response.json().get("detail"))
            except ValueError:
                detail = response.text[:200]
            raise AgentRejected(response.status_code, detail)
        return response

    async def apply(self, agent_url: str, secret: str, command: AllocationCommand) -> AllocationAck:
        """Send an allocation; returns the agent's acknowledgement."""
        response = await self._post(
            f"{agent_url.rstrip('/')}/jobs/{command.job_id}/allocation", secret, command
        )
        return AllocationAck.model_validate_json(response.content)

    async def stop(self, agent_url: str, secret: str, command: StopCommand) -> None:
        """Stop a job on an agent."""
        await self._post(f"{agent_url.rstrip('/')}/jobs/{command.job_id}/stop", secret, command)

    async def aclose(self) -> None:
        """Close connections."""
        await self._http.aclose()
