"""`greenflow demo`: the scheduler, one local agent with simulated GPUs and a compressed carbon clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console

from scheduler_service.auth.service import create_token
from scheduler_service.auth.tokens import Role
from scheduler_service.db import migrate
from scheduler_service.db.session import make_engine, make_session_factory, transaction

# One trace hour every 5 wall-clock seconds; a 24-hour day of grid carbon in two minutes.
DEMO_NODE = "local-agent"
DEMO_CONFIG = """\
# Written by `greenflow demo`: a compressed day so carbon-aware decisions show within minutes.
[budget]
period = "day"
# The budget's day is the replay's (two minutes), as is the idle/host reserve until its end.
period_clock = "carbon"
limit_kg_co2e = {budget_kg}
enforcement = "hard"

[carbon]
provider = "synthetic"
region = "demo"
clock_speedup = 720.0
seed = 7

[planner]
slot_s = 5
horizon_s = 120
solver_time_limit_s = 2.0

[cluster]
pue = 1.2
heartbeat_timeout_s = 15
agent_heartbeat_interval_s = 1
agent_telemetry_interval_s = 1
"""

DEMO_JOBS: list[dict[str, Any]] = [
    {
        "name": "gpt-tiny-pretrain",
        "workload": "gpt-tiny",
        "global_batch_size": 16,
        "total_samples": 16_000,
        "min_gpus": 1,
        "max_gpus": 4,
        "priority": 2,
    },
    {
        "name": "bert-tiny-finetune",
        "workload": "bert-tiny",
        "global_batch_size": 16,
        "total_samples": 12_000,
        "min_gpus": 1,
        "max_gpus": 2,
    },
    {
        "name": "mlp-sweep",
        "workload": "mlp",
        "global_batch_size": 32,
        "total_samples": 24_000,
        "min_gpus": 1,
        "max_gpus": 2,
    },
]


@dataclass(frozen=True)
class DemoSummary:
    """The JSON line `greenflow demo` prints last."""

    jobs: int
    completed: int
    hot_switches: int
    energy_kwh: float
    emissions_kg: float
    budget_kg: float


def _greenflow() -> str:
    return str(Path(sys.executable).parent / "greenflow")


def _wait_for(url: str, process: subprocess.Popen[bytes], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} during start-up")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout_s:.0f} s")


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class _Watcher:
    """Prints allocation changes, hot switches and state changes as they happen."""

    def __init__(self, api: httpx.Client, console: Console) -> None:
        self.api = api
        self.console = console
        self.seen: dict[int, int] = {}
        self.hot_switches = 0

    def poll(self) -> list[dict[str, Any]]:
        jobs = self.api.get("/v1/jobs", params={"limit": 500}).json()["items"]
        for job in sorted(jobs, key=lambda j: j["id"]):
            for event in self.api.get(f"/v1/jobs/{job['id']}/events").json():
                if event["id"] <= self.seen.get(job["id"], 0):
                    continue
                self.seen[job["id"]] = event["id"]
                self._print(job, event)
        return list(jobs)

    def _print(self, job: dict[str, Any], event: dict[str, Any]) -> None:
        at = event["at"][11:19]
        name = f"job {job['id']} ({job['name']})"
        if event["kind"] == "hot_switch":
            self.hot_switches += 1
            self.console.print(
                f"[dim]{at}[/dim] [bold magenta]hot switch[/] {name}: {event['reason']}"
            )
        elif event["kind"] == "allocation":
            self.console.print(
                f"[dim]{at}[/dim] [bold cyan]allocation[/] {name}: {event['reason']}"
            )
        elif event["kind"] == "state" and event["to_state"] != "PENDING":
            self.console.print(
                f"[dim]{at}[/dim] {name}: {event['from_state']} → [bold]{event['to_state']}[/] ({event['reason']})"
            )


def example_job(example: Path) -> dict[str, Any]:
    """The job spec of an example directory (its job.yaml), checked enough to name problems."""
    spec_path = example / "job.yaml"
    try:
        spec = yaml.safe_load(spec_path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise RuntimeError(f"--example {example}: cannot read {spec_path}: {exc}") from exc
    if not isinstance(spec, dict) or ":" not in str(spec.get("workload", "")):
        raise RuntimeError(f"--example {example}: job.yaml must name a module:function workload")
    return spec


def _submit_example(
    api: httpx.Client, example: Path, spec: dict[str, Any], console: Console
) -> dict[str, Any]:
    """Pack and upload the example directory, then submit its job with the bundle."""
    from worker_agent.bundle import BundleError, pack_directory

    try:
        bundle = pack_directory(example)
    except (BundleError, OSError) as exc:
        raise RuntimeError(f"--example {example}: {exc}") from exc
    stored = api.put(
        f"/v1/bundles/{bundle.sha256}",
        content=bundle.data,
        headers={"content-type": "application/octet-stream"},
    )
    if stored.status_code not in (200, 201):
        raise RuntimeError(f"--example {example}: upload refused: {stored.text[:300]}")
    response = api.post("/v1/jobs", json={**spec, "bundle": bundle.sha256})
    if response.status_code != 201:
        raise RuntimeError(f"--example {example}: job refused: {response.text[:300]}")
    job: dict[str, Any] = response.json()
    console.print(
        f"submitted job {job['id']} {spec['name']} ({spec['workload']} from {example}, "
        f"bundle {bundle.sha256[:12]}, {len(bundle.files)} files)"
    )
    return job


def run_demo(
    *,
    duration_s: float | None,
    port: int,
    gpus: int,
    budget_kg: float,
    workdir: Path | None,
    example: Path | None = None,
) -> DemoSummary:
    """Run the whole stack until `duration_s` passes (or Ctrl-C) and summarise what happened;
    with `example`, a user job directory (job.yaml + module) runs beside the demo's jobs."""
    console = Console()
    example_spec = example_job(example) if example is not None else None
    work = workdir or Path(tempfile.mkdtemp(prefix="greenflow-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "greenflow-demo.toml"
    config = DEMO_CONFIG.format(budget_kg=budget_kg)
    if example_spec is not None:
        module = str(example_spec["workload"]).split(":", 1)[0]
        config += f'\n[workloads]\nallowed_entrypoints = ["{module}"]\n'
    config_path.write_text(config)
    database_url = f"sqlite:///{work / 'greenflow-demo.db'}"
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    with transaction(make_session_factory(engine)) as session:
        operator = create_token(session, name="demo-operator", role=Role.OPERATOR)
        # The agent's credential is named after its node.
        agent_token = create_token(session, name=DEMO_NODE, role=Role.AGENT)
    engine.dispose()
    env = {
        **os.environ,
        "GREENFLOW_DATABASE_URL": database_url,
        "GREENFLOW_CONFIG": str(config_path),
        "GREENFLOW_PORT": str(port),
        "GREENFLOW_HOST": "127.0.0.1",
    }
    url = f"http://127.0.0.1:{port}"
    server: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {operator}"}, timeout=30)
    watcher = _Watcher(api, console)
    started = time.monotonic()
    jobs: list[dict[str, Any]] = []
    try:
        with (
            (work / "scheduler.log").open("wb") as server_log,
            (work / "agent.log").open("wb") as agent_log,
        ):
            server = subprocess.Popen(
                [_greenflow(), "serve"], env=env, stdout=server_log, stderr=subprocess.STDOUT
            )
            _wait_for(f"{url}/healthz", server, "the scheduler")
            agent = subprocess.Popen(
                [
                    _greenflow(),
                    "agent",
                    "--scheduler",
                    url,
                    "--simulate-gpus",
                    str(gpus),
                    "--name",
                    DEMO_NODE,
                    "--checkpoint-dir",
                    str(work / "checkpoints"),
                    "--checkpoint-interval-s",
                    "30",
                    "--export-dir",
                    str(work / "exports"),
                ],
                # The node's credential from the environment: a command line is visible in ps.
                env={**env, "GREENFLOW_AGENT_TOKEN": agent_token},
                stdout=agent_log,
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + 60
            while not api.get("/v1/nodes").json():
                if agent.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the agent did not register (see {work / 'agent.log'})")
                time.sleep(0.3)
            console.print(
                f"[bold green]GreenFlow demo[/] — scheduler {url} (API docs {url}/docs, console {url}/console)"
            )
            console.print(f"operator token: {operator}")
            console.print(
                f"logs and database in {work}; carbon: synthetic grid, 1 trace hour every 5 s; budget {budget_kg} kg CO2e per day"
            )
            for spec in DEMO_JOBS:
                job = api.post("/v1/jobs", json=spec).json()
                console.print(
                    f"submitted job {job['id']} {spec['name']} ({spec['workload']}, {spec['min_gpus']}-{spec['max_gpus']} GPUs)"
                )
            if example is not None and example_spec is not None:
                job = _submit_example(api, example, example_spec, console)
                console.print(
                    f"its output: greenflow logs {job['id']}; its model, once finished: "
                    f"{work / 'exports' / ('job-' + str(job['id']))}"
                )
            last_carbon = 0.0
            while duration_s is None or time.monotonic() - started < duration_s:
                jobs = watcher.poll()
                if time.monotonic() - last_carbon > 10:
                    last_carbon = time.monotonic()
                    carbon = api.get("/v1/carbon", params={"history_s": 60}).json()
                    if carbon["forecast"]:
                        now = carbon["forecast"][0]["intensity_g_per_kwh"]
                        console.print(
                            f"[dim]grid now {now:.0f} g CO2e/kWh{' (degraded: ' + str(carbon['degraded_reason']) + ')' if carbon['degraded'] else ''}[/dim]"
                        )
                if server.poll() is not None or agent.poll() is not None:
                    raise RuntimeError(f"a demo process exited early (see logs in {work})")
                time.sleep(1)
            jobs = watcher.poll()
    except KeyboardInterrupt:
        console.print("stopping…")
    finally:
        budget: dict[str, Any] = {}
        try:
            budget = api.get("/v1/budget").json()
            jobs = api.get("/v1/jobs", params={"limit": 500}).json()["items"]
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        api.close()
        _stop(agent)
        _stop(server)
    return DemoSummary(
        jobs=len(jobs),
        completed=sum(1 for j in jobs if j["state"] == "SUCCEEDED"),
        hot_switches=watcher.hot_switches,
        energy_kwh=float(budget.get("total_energy_kwh", 0.0)),
        emissions_kg=float(budget.get("total_emissions_kg_co2e", 0.0)),
        budget_kg=budget_kg,
    )


def summary_line(summary: DemoSummary) -> str:
    """The JSON summary as one line."""
    return json.dumps(asdict(summary))
