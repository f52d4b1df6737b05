"""The `greenflow` command line: serve, migrate, tokens, and the user commands."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from scheduler_service.auth.tokens import Role
from scheduler_service.client import ApiError, GreenflowClient
from scheduler_service.settings import ConfigError, GreenflowConfig, Settings, load_config

app = typer.Typer(
    name="greenflow",
    help="GreenFlow: carbon-aware scheduling of elastic deep-learning training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")

out = Console()
err = Console(stderr=True)

USAGE_ERROR = 2


def fail(message: str, code: int = 1) -> NoReturn:
    """Print a one-line error and exit."""
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _settings_and_config() -> tuple[Settings, GreenflowConfig]:
    try:
        settings = Settings()
        return settings, load_config(settings.config)
    except ConfigError as exc:
        fail(str(exc), USAGE_ERROR)
    except ValidationError as exc:
        first = exc.errors()[0]
        fail(
            f"invalid environment setting GREENFLOW_{str(first['loc'][0]).upper()}: {first['msg']}",
            USAGE_ERROR,
        )


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Apply the database migrations."""
    from scheduler_service.db import migrate

    settings, _ = _settings_and_config()
    migrate.upgrade(settings.database_url, revision)
    out.print(f"database at revision {migrate.current_revision(settings.database_url)}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="Target revision (or 'base').")) -> None:
    """Revert the database migrations to a revision."""
    from scheduler_service.db import migrate

    settings, _ = _settings_and_config()
    migrate.downgrade(settings.database_url, revision)
    out.print(f"database at revision {migrate.current_revision(settings.database_url)}")


@token_app.command("create")
def token_create(
    role: Annotated[Role, typer.Option(help="user, operator or agent.")],
    name: Annotated[str, typer.Option(help="Who the token is for (jobs are owned by this name).")],
    from_env: Annotated[
        str | None,
        typer.Option(
            help="Store the token held in this environment variable instead of minting one (deployments)."
        ),
    ] = None,
) -> None:
    """Create an API token and print it once (only its hash is stored)."""
    from scheduler_service.auth.service import create_token, import_token
    from scheduler_service.db.session import make_engine, make_session_factory, transaction

    settings, _ = _settings_and_config()
    given = None
    if from_env is not None:
        given = os.environ.get(from_env)
        if not given:
            fail(f"environment variable {from_env} is not set", USAGE_ERROR)
    _require_migrated(settings)
    engine = make_engine(settings.database_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            if given is None:
                print(create_token(session, name=name, role=role))
            else:
                stored = import_token(session, name=name, role=role, plaintext=given)
                out.print(
                    f"token from {from_env} {'stored' if stored else 'was already stored'} for {name} ({role.value})"
                )
    except ValueError as exc:
        fail(str(exc), USAGE_ERROR)
    finally:
        engine.dispose()


def _require_migrated(settings: Settings) -> None:
    from scheduler_service.db import migrate

    heads = migrate.head_revisions()
    current = migrate.current_revision(settings.database_url)
    if current not in heads:
        fail(
            f"database schema is at {current or 'nothing'}, not at {heads[0]}: run `greenflow db upgrade`",
            USAGE_ERROR,
        )


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default GREENFLOW_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default GREENFLOW_PORT).")] = None,
) -> None:
    """Run the scheduler: REST API and control loop."""
    import uvicorn

    from scheduler_service.app import create_app

    settings, config = _settings_and_config()
    _require_migrated(settings)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    application = create_app(settings, config)
    uvicorn.run(
        application, host=host or settings.host, port=port or settings.port, log_level="info"
    )


def _client() -> GreenflowClient:
    url = os.environ.get("GREENFLOW_URL", "http://127.0.0.1:8080")
    token = os.environ.get("GREENFLOW_TOKEN")
    if not token:
        fail("GREENFLOW_TOKEN is not set (create one with `greenflow token create`)", USAGE_ERROR)
    return GreenflowClient(url, token)


def _call(method: str, path: str, **kwargs: Any) -> Any:
    client = _client()
    try:
        return client.request(method, path, **kwargs)
    except ApiError as exc:
        code = USAGE_ERROR if exc.status in (400, 409, 422) else 1
        fail(exc.args[0], code)
    finally:
        client.close()


def _job_table(jobs: list[dict[str, Any]]) -> Table:
    table = Table("ID", "NAME", "OWNER", "STATE", "GPUS", "PROGRESS", "DEADLINE (UTC)")
    for job in jobs:
        total = job["total_samples"] or (job["total_steps"] or 0) * job["global_batch_size"]
        progress = f"{100 * job['samples_done'] / total:.1f}%" if total else "-"
        gpus = f"{job['current_gpus']} ({job['min_gpus']}-{job['max_gpus']})"
        table.add_row(
            str(job["id"]),
            job["name"],
            job["owner"],
            job["state"],
            gpus,
            progress,
            (job["deadline"] or "-").replace("T", " ")[:19],
        )
    return table


@app.command()
def submit(spec_file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")]) -> None:
    """Submit a job from a YAML or JSON spec file."""
    from scheduler_service.jobs.schemas import JobSpec

    try:
        raw = yaml.safe_load(spec_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        fail(f"{spec_file}: no such file", USAGE_ERROR)
    except yaml.YAMLError as exc:
        fail(f"{spec_file}: not valid YAML/JSON: {str(exc).splitlines()[0]}", USAGE_ERROR)
    if not isinstance(raw, dict):
        fail(f"{spec_file}: expected a mapping of job fields at the top level", USAGE_ERROR)
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "spec"
        fail(f"{spec_file}: {field}: {first['msg']}", USAGE_ERROR)
    job = _call("POST", "/v1/jobs", json=json.loads(spec.model_dump_json(exclude_none=True)))
    out.print(f"job {job['id']} {job['state']}: {job['state_reason']}")


@app.command()
def jobs(
    state: Annotated[list[str] | None, typer.Option(help="Filter by state (repeatable).")] = None,
    owner: Annotated[str | None, typer.Option(help="Filter by owner (operators).")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500)] = 50,
) -> None:
    """List jobs."""
    params: dict[str, Any] = {"limit": limit}
    if state:
        params["state"] = [s.upper() for s in state]
    if owner:
        params["owner"] = owner
    page = _call("GET", "/v1/jobs", params=params)
    out.print(_job_table(page["items"]))
    out.print(f"{len(page['items'])} of {page['total']} jobs")


@app.command()
def job(job_id: Annotated[int, typer.Argument(min=1)]) -> None:
    """Show one job and its events."""
    data = _call("GET", f"/v1/jobs/{job_id}")
    out.print(_job_table([data]))
    events = _call("GET", f"/v1/jobs/{job_id}/events")
    table = Table("AT (UTC)", "EVENT", "REASON", "BY")
    for event in events:
        what = (
            f"{event['from_state'] or '-'} → {event['to_state']}"
            if event["kind"] == "state"
            else event["kind"]
        )
        table.add_row(event["at"].replace("T", " ")[:19], what, event["reason"], event["actor"])
    out.print(table)


@app.command()
def cancel(
    job_id: Annotated[int, typer.Argument(min=1)],
    reason: Annotated[
        str, typer.Option(help="Why (recorded in the job's events).")
    ] = "cancelled by user",
) -> None:
    """Cancel a job."""
    data = _call("POST", f"/v1/jobs/{job_id}/cancel", json={"reason": reason})
    out.print(f"job {data['id']} {data['state']}")


@app.command()
def demo(
    duration: Annotated[
        float | None, typer.Option(help="Stop by itself after this many seconds.", min=1)
    ] = None,
    port: Annotated[int, typer.Option(help="Port of the scheduler.", min=1, max=65535)] = 8080,
    gpus: Annotated[
        int, typer.Option(help="Simulated GPU slots of the local agent.", min=1, max=64)
    ] = 4,
    budget_kg: Annotated[
        float, typer.Option(help="Carbon budget per (compressed) day, kg CO2e.", min=0.0001)
    ] = 0.05,
    workdir: Annotated[
        Path | None, typer.Option(help="Where to keep the database and logs (default: a temp dir).")
    ] = None,
) -> None:
    """Run the scheduler, a local agent with simulated GPUs and a compressed carbon day; submit example jobs."""
    from scheduler_service.demo import run_demo, summary_line

    try:
        summary = run_demo(
            duration_s=duration, port=port, gpus=gpus, budget_kg=budget_kg, workdir=workdir
        )
    except RuntimeError as exc:
        fail(str(exc))
    print(summary_line(summary))


def _register_commands() -> None:
    # The agent and the simulator live in their own packages; the CLI is where they meet.
    from scheduler_service.simulate.cli import simulate
    from worker_agent.cli import agent

    app.command(name="agent")(agent)
    app.command(name="simulate")(simulate)


_register_commands()


def main() -> None:
    """Entry point of the `greenflow` script."""
    from worker_agent.cli import run_app

    run_app(app)


if __name__ == "__main__":
    main()
