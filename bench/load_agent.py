"""A light load agent: one process that speaks for N nodes by the real agent protocol, no training.

Each node registers with its own credential (`POST /v1/nodes/register`), heartbeats with the jobs
it holds (`POST /v1/nodes/{name}/heartbeat`) and reports synthetic telemetry for them
(`POST /v1/telemetry`: a fixed step rate and power per GPU, "estimated" power). The scheduler's
commands arrive on one HTTP server at `/n/{node}/jobs/{job_id}/allocation` and `.../stop`, checked
against the node's secret, and are acknowledged at once (a hot switch that takes no time). So
64-256 nodes fit on a laptop beside `greenflow serve`.

Usage:
    python -m bench.load_agent --scheduler URL --tokens FILE [--gpus-per-node 8] [--port P]
        [--telemetry-s 5]

`FILE` holds one `node-name token` pair per line. On SIGTERM it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Header, HTTPException

from worker_agent.protocol import (
    AllocationAck,
    AllocationCommand,
    GpuSlotInfo,
    Heartbeat,
    NodeRegistered,
    NodeRegistration,
    RunningJob,
    StopCommand,
    TelemetryReport,
    TelemetrySample,
)

# Synthetic speed and power of one GPU (a mid-size model on an A100-class card).
SAMPLES_PER_S_PER_GPU = 400.0
POWER_W_PER_GPU = 300.0


@dataclass
class Held:
    """A job one node runs: its generation, slots and synthetic progress."""

    generation: int
    slots: list[int]
    samples_done: int = 0
    step: int = 0


@dataclass
class FakeNode:
    """One node this process speaks for."""

    name: str
    token: str
    gpus: int
    secret: str = ""
    jobs: dict[int, Held] = field(default_factory=dict)
    registered: bool = False


class LoadAgent:
    """The nodes, their server routes and their loops."""

    def __init__(self, scheduler: str, nodes: list[FakeNode], base_url: str) -> None:
        self.scheduler = scheduler.rstrip("/")
        self.nodes = {node.name: node for node in nodes}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(
            timeout=30.0, limits=httpx.Limits(max_connections=32, max_keepalive_connections=32)
        )
        self.heartbeat_s = 5.0
        self.telemetry_s = 5.0
        self.applied = 0
        self.stopped = 0
        self._ids = itertools.count()

    def app(self) -> FastAPI:
        """The agent side of the protocol for every node, under /n/{node}."""
        app = FastAPI()

        def node_for(name: str, secret: str | None) -> FakeNode:
            node = self.nodes.get(name)
            if node is None:
                raise HTTPException(404, f"no node {name}")
            if not secret or secret != node.secret:
                raise HTTPException(401, "wrong agent secret")
            return node

        @app.post("/n/{name}/jobs/{job_id}/allocation")
        async def allocation(
            name: str,
            job_id: int,
            command: AllocationCommand,
            x_greenflow_agent_secret: str | None = Header(default=None),
        ) -> AllocationAck:
            node = node_for(name, x_greenflow_agent_secret)
            held = node.jobs.get(job_id)
            # As the real agent: an older generation is refused, the same one acknowledged again.
            if held is not None and command.generation < held.generation:
                raise HTTPException(409, f"stale generation {command.generation}")
            if held is not None and command.generation == held.generation:
                return AllocationAck(
                    job_id=job_id,
                    generation=held.generation,
                    gpus=len(held.slots),
                    layout=f"dp{len(held.slots)}",
                    step=held.step,
                    worker_pids=[],
                )
            step = 0 if held is None else held.step
            done = 0 if held is None else held.samples_done
            if command.slot_indices:
                node.jobs[job_id] = Held(command.generation, list(command.slot_indices), done, step)
            else:
                node.jobs.pop(job_id, None)
            self.applied += 1
            return AllocationAck(
                job_id=job_id,
                generation=command.generation,
                gpus=len(command.slot_indices),
                layout=f"dp{len(command.slot_indices)}" if command.slot_indices else None,
                step=step,
                worker_pids=[],
                hot_switch=held is not None,
                switch_s=0.0 if held is not None else None,
            )

        @app.post("/n/{name}/jobs/{job_id}/stop")
        async def stop(
            name: str,
            job_id: int,
            command: StopCommand,
            x_greenflow_agent_secret: str | None = Header(default=None),
        ) -> dict[str, Any]:
            node = node_for(name, x_greenflow_agent_secret)
            node.jobs.pop(job_id, None)
            self.stopped += 1
            return {"job_id": job_id, "generation": command.generation}

        @app.get("/healthz")
        async def healthz() -> dict[str, Any]:
            registered = sum(1 for n in self.nodes.values() if n.registered)
            return {"nodes": len(self.nodes), "registered": registered, "applied": self.applied}

        return app

    async def register(self, node: FakeNode) -> None:
        """Register one node (again after the scheduler forgot it)."""
        body = NodeRegistration(
            name=node.name,
            agent_url=f"{self.base_url}/n/{node.name}",
            slots=[GpuSlotInfo(index=i) for i in range(node.gpus)],
        )
        response = await self.http.post(
            f"{self.scheduler}/v1/nodes/register",
            content=body.model_dump_json(),
            headers=self._auth(node),
        )
        response.raise_for_status()
        ack = NodeRegistered.model_validate_json(response.content)
        node.secret = ack.agent_secret
        node.registered = True
        self.heartbeat_s = ack.heartbeat_interval_s
        node.jobs.clear()

    def _auth(self, node: FakeNode) -> dict[str, str]:
        return {"Authorization": f"Bearer {node.token}", "content-type": "application/json"}

    async def heartbeat(self, node: FakeNode) -> None:
        """One heartbeat with the node's jobs; stops the ones the scheduler no longer wants."""
        beat = Heartbeat(
            jobs=[
                RunningJob(
                    job_id=job_id,
                    generation=held.generation,
                    gpus=len(held.slots),
                    slot_indices=held.slots,
                    layout=f"dp{len(held.slots)}",
                    step=held.step,
                    samples_done=held.samples_done,
                    worker_pids=[],
                )
                for job_id, held in node.jobs.items()
            ]
        )
        response = await self.http.post(
            f"{self.scheduler}/v1/nodes/{node.name}/heartbeat",
            content=beat.model_dump_json(),
            headers=self._auth(node),
        )
        if response.status_code == 404:
            await self.register(node)
            return
        response.raise_for_status()
        for job_id in response.json().get("stop_job_ids", []):
            node.jobs.pop(int(job_id), None)

    async def telemetry(self, node: FakeNode, interval_s: float) -> None:
        """Synthetic samples for every job the node holds."""
        if not node.jobs:
            return
        now = datetime.now(UTC)
        samples = []
        for job_id, held in node.jobs.items():
            gpus = len(held.slots)
            rate = SAMPLES_PER_S_PER_GPU * gpus
            held.samples_done += int(rate * interval_s)
            held.step += int(interval_s)
            power_w = POWER_W_PER_GPU * gpus
            samples.append(
                TelemetrySample(
                    sample_id=f"{node.name}-{job_id}-{next(self._ids)}",
                    job_id=job_id,
                    generation=held.generation,
                    at=now,
                    interval_s=interval_s,
                    step=held.step,
                    samples_done=held.samples_done,
                    samples_per_s=rate,
                    gpus=gpus,
                    layout=f"dp{gpus}",
                    power_w=power_w,
                    energy_kwh=power_w * interval_s / 3.6e6,
                    power_source="estimated",
                )
            )
        report = TelemetryReport(samples=samples, node=node.name)
        await self.http.post(
            f"{self.scheduler}/v1/telemetry",
            content=report.model_dump_json(),
            headers=self._auth(node),
        )

    async def node_loop(self, node: FakeNode, offset_s: float) -> None:
        """Register, then heartbeat and report telemetry on the scheduler's intervals."""
        await asyncio.sleep(offset_s)
        while not node.registered:
            try:
                await self.register(node)
            except httpx.HTTPError:
                await asyncio.sleep(1.0)
        last_telemetry = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.heartbeat_s)
            with contextlib.suppress(httpx.HTTPError):
                await self.heartbeat(node)
                now = asyncio.get_running_loop().time()
                if now - last_telemetry >= self.telemetry_s:
                    await self.telemetry(node, now - last_telemetry)
                    last_telemetry = now


async def run(args: argparse.Namespace) -> None:
    """Serve the nodes' endpoint and run every node's loop until SIGTERM."""
    nodes = []
    with open(args.tokens) as handle:
        for line in handle:
            if line.strip():
                name, token = line.split()
                nodes.append(FakeNode(name, token, args.gpus_per_node))
    agent = LoadAgent(args.scheduler, nodes, f"http://127.0.0.1:{args.port}")
    agent.telemetry_s = args.telemetry_s
    config = uvicorn.Config(
        agent.app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    spread_s = max(1.0, agent.heartbeat_s)
    loops = [
        asyncio.create_task(agent.node_loop(node, spread_s * i / max(1, len(nodes))))
        for i, node in enumerate(nodes)
    ]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    for task in loops:
        task.cancel()
    server.should_exit = True
    await serving
    await agent.http.aclose()


def main() -> None:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--telemetry-s", type=float, default=5.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
