"""The `greenflow` command line: serve, migrate, tokens, and the user commands."""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from scheduler_service.auth.tokens import Role
from scheduler_service.client import ApiError, GreenflowClient

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    # Typer bundles its own click; its group's methods take and return these types.
    from typer._click.core import Command, Context

    from scheduler_service.settings import GreenflowConfig, Settings

# Commands whose modules are heavy (the simulator pulls in OR-Tools, scipy and torch): imported
# only when that command runs, so client commands start fast. name -> (module, function).
LAZY_COMMANDS = {
    "agent": ("worker_agent.cli", "agent"),
    "simulate": ("scheduler_service.simulate.cli", "simulate"),
}


class LazyGroup(TyperGroup):
    """The `greenflow` group: commands in LAZY_COMMANDS are imported when first looked up."""

    def list_commands(self, ctx: Context) -> list[str]:
        """Every command name, the lazy ones included."""
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        """The command of this name, importing its module if it is a lazy one."""
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            module_name, attr = LAZY_COMMANDS[cmd_name]
            function = getattr(importlib.import_module(module_name), attr)
            single = typer.Typer(pretty_exceptions_enable=False)
            single.command(name=cmd_name)(function)
            self.add_command(typer.main.get_command(single), cmd_name)
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    name="greenflow",
    help="GreenFlow: carbon-aware scheduling of elastic deep-learning training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=LazyGroup,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
node_app = typer.Typer(help="Node credentials.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
app.add_typer(node_app, name="node")

out = Console()
err = Console(stderr=True)

USAGE_ERROR = 2


def fail(message: str, code: int = 1) -> NoReturn:
    """Print a one-line error and exit."""
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _settings_and_config() -> tuple[Settings, GreenflowConfig]:
    # Imported here: the settings pull in the carbon providers (numpy), which client commands skip.
    from scheduler_service.settings import ConfigError, Settings, load_config

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


@contextmanager
def _db_session() -> Iterator[Session]:
    """A transaction on the configured, migrated database (for the token and node commands)."""
    from scheduler_service.db.session import make_engine, make_session_factory, transaction

    settings, _ = _settings_and_config()
    _require_migrated(settings)
    engine = make_engine(settings.database_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            yield session
    finally:
        engine.dispose()


def _expiry(days: float | None) -> datetime | None:
    if days is None:
        return None
    return datetime.now(UTC) + timedelta(days=days)


ExpiresOption = Annotated[
    float | None,
    typer.Option(help="Valid for this many days (default: until revoked).", min=0.001, max=36500),
]
ReplaceOption = Annotated[
    bool, typer.Option(help="Revoke the active token of the same role and name first.")
]


@token_app.command("create")
def token_create(
    role: Annotated[Role, typer.Option(help="user, operator or agent.")],
    name: Annotated[
        str,
        typer.Option(
            help="Who the token is for: jobs are owned by this name; an agent token speaks "
            "for the node of this name. One active token per role and name."
        ),
    ],
    from_env: Annotated[
        str | None,
        typer.Option(
            help="Store the token held in this environment variable instead of minting one (deployments)."
        ),
    ] = None,
    expires_in_days: ExpiresOption = None,
    replace: ReplaceOption = False,
) -> None:
    """Create an API token and print it once (only its hash is stored)."""
    from scheduler_service.auth.service import TokenError, create_token, import_token

    given = None
    if from_env is not None:
        given = os.environ.get(from_env)
        if not given:
            fail(f"environment variable {from_env} is not set", USAGE_ERROR)
    try:
        with _db_session() as session:
            if given is None:
                print(
                    create_token(
                        session,
                        name=name,
                        role=role,
                        expires_at=_expiry(expires_in_days),
                        replace=replace,
                    )
                )
            else:
                stored = import_token(session, name=name, role=role, plaintext=given)
                out.print(
                    f"token from {from_env} {'stored' if stored else 'was already stored'} for {name} ({role.value})"
                )
    except TokenError as exc:
        fail(str(exc), USAGE_ERROR)


def _when(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M") if at is not None else "-"


@token_app.command("list")
def token_list(
    all_tokens: Annotated[bool, typer.Option("--all", help="Include revoked tokens.")] = False,
) -> None:
    """List tokens: id, name, role, dates (never a secret)."""
    from scheduler_service.auth.service import list_tokens

    with _db_session() as session:
        rows = list_tokens(session, include_revoked=all_tokens)
        table = Table("ID", "NAME", "ROLE", "CREATED", "LAST USED", "EXPIRES", "REVOKED")
        for row in rows:
            table.add_row(
                row.token_id,
                row.name,
                row.role,
                _when(row.created_at),
                _when(row.last_used_at),
                _when(row.expires_at),
                _when(row.revoked_at),
            )
    # Wide enough that ids are never cut, even when stdout is not a terminal.
    Console(width=max(out.width, 140)).print(table)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (`greenflow token list`).")],
) -> None:
    """Revoke a token: it stops working at once."""
    from scheduler_service.auth.service import TokenError, revoke_token

    try:
        with _db_session() as session:
            row = revoke_token(session, token_id)
            out.print(f"token {row.token_id} ({row.name}, {row.role}) revoked")
    except TokenError as exc:
        fail(str(exc), USAGE_ERROR)


@node_app.command("enrol")
def node_enrol(
    name: Annotated[str, typer.Argument(help="The node's name (the agent's --name).")],
    expires_in_days: ExpiresOption = None,
    replace: ReplaceOption = False,
) -> None:
    """Create a node's own credential and print it once: give it to that node's agent only."""
    from scheduler_service.auth.service import TokenError, create_token

    try:
        with _db_session() as session:
            print(
                create_token(
                    session,
                    name=name,
                    role=Role.AGENT,
                    expires_at=_expiry(expires_in_days),
                    replace=replace,
                )
            )
    except TokenError as exc:
        fail(str(exc), USAGE_ERROR)


@node_app.command("revoke")
def node_revoke(name: Annotated[str, typer.Argument(help="The node's name.")]) -> None:
    """Revoke a node's credential and take the node out of service (its jobs are re-queued)."""
    from scheduler_service.nodes.service import revoke_node

    with _db_session() as session:
        count = revoke_node(session, name)
    if count == 0:
        fail(f"node {name!r} has no active credential", USAGE_ERROR)
    out.print(f"node {name}: credential revoked; the node is out of service")


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
def submit(
    spec_file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")],
    workdir: Annotated[
        Path | None,
        typer.Option(
            help="Directory holding the job module: packed (without .gitignore/.greenflowignore "
            "matches), uploaded, and imported from on the agents.",
            file_okay=False,
        ),
    ] = None,
    follow: Annotated[
        bool, typer.Option(help="Show the job's progress and state changes until it ends.")
    ] = False,
) -> None:
    """Submit a job from a YAML or JSON spec file (with its code from --workdir)."""
    from scheduler_service.jobs.schemas import JobSpec

    try:
        raw = yaml.safe_load(spec_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        fail(f"{spec_file}: no such file", USAGE_ERROR)
    except UnicodeDecodeError as exc:
        fail(f"{spec_file}: not UTF-8 text (byte {exc.start}): a spec is YAML or JSON", USAGE_ERROR)
    except OSError as exc:
        fail(f"{spec_file}: cannot read it: {exc.strerror or exc}", USAGE_ERROR)
    except yaml.YAMLError as exc:
        fail(f"{spec_file}: not valid YAML/JSON: {str(exc).splitlines()[0]}", USAGE_ERROR)
    if not isinstance(raw, dict):
        fail(f"{spec_file}: expected a mapping of job fields at the top level", USAGE_ERROR)
    if workdir is not None:
        raw["bundle"] = _upload_workdir(workdir)
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "spec"
        fail(f"{spec_file}: {field}: {first['msg']}", USAGE_ERROR)
    job = _call("POST", "/v1/jobs", json=json.loads(spec.model_dump_json(exclude_none=True)))
    out.print(f"job {job['id']} {job['state']}: {job['state_reason']}")
    if follow:
        _follow_job(job["id"])


def _upload_workdir(workdir: Path) -> str:
    """Pack `workdir` into a bundle, upload it, and return its SHA-256."""
    from worker_agent.bundle import BundleError, pack_directory

    try:
        bundle = pack_directory(workdir)
    except (BundleError, OSError) as exc:
        fail(f"--workdir {workdir}: {exc}", USAGE_ERROR)
    stored = _call(
        "PUT",
        f"/v1/bundles/{bundle.sha256}",
        content=bundle.data,
        headers={"content-type": "application/octet-stream"},
    )
    skipped = f", {len(bundle.skipped)} link(s)/special file(s) left out" if bundle.skipped else ""
    out.print(
        f"workdir {workdir}: {len(bundle.files)} file(s), {stored['size_bytes']} bytes packed, "
        f"bundle {bundle.sha256[:12]}{skipped}",
        highlight=False,
    )
    return bundle.sha256


TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "DEADLINE_MISSED"})


def _event_line(event: dict[str, Any]) -> str:
    what = (
        f"{event['from_state'] or '-'} -> {event['to_state']}"
        if event["kind"] == "state"
        else event["kind"]
    )
    return f"{event['at'].replace('T', ' ')[:19]}  {what}: {event['reason']}"


def _follow_job(job_id: int, poll_s: float = 1.0) -> None:
    """Show a job's progress (samples, GPUs, layout, ETA) and its events until it ends."""
    import time

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    seen = 0
    data = _call("GET", f"/v1/jobs/{job_id}")
    total = data["total_samples"] or (data["total_steps"] or 0) * data["global_batch_size"]
    columns = (
        TextColumn("job {task.fields[job]} [bold]{task.fields[state]}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("samples  {task.fields[gpus]} GPU(s) {task.fields[layout]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=out, transient=False) as progress:
        task = progress.add_task("", total=total or None, job=job_id, state="", gpus=0, layout="")
        while True:
            events = _call("GET", f"/v1/jobs/{job_id}/events", params={"offset": seen})
            for event in events:
                progress.console.print(_event_line(event), highlight=False)
            seen += len(events)
            progress.update(
                task,
                completed=data["samples_done"],
                state=data["state"],
                gpus=data["current_gpus"],
                layout=data["current_layout"] or "-",
            )
            if data["state"] in TERMINAL and not events:
                break
            time.sleep(poll_s)
            data = _call("GET", f"/v1/jobs/{job_id}")
    out.print(f"job {job_id} {data['state']}: {data['state_reason']}", highlight=False)
    if data["state"] != "SUCCEEDED":
        raise typer.Exit(1)


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
def report(
    period: Annotated[str, typer.Option(help="A month YYYY-MM or a day YYYY-MM-DD (UTC).")],
    by: Annotated[str, typer.Option(help="Sum per job, queue or user.")] = "job",
    format: Annotated[str, typer.Option(help="csv or json.")] = "csv",
) -> None:
    """Energy and emissions of a period per job, queue or user (as the console's download)."""
    if by not in ("job", "queue", "user"):
        fail(f"--by {by!r}: expected job, queue or user", USAGE_ERROR)
    if format not in ("csv", "json"):
        fail(f"--format {format!r}: expected csv or json", USAGE_ERROR)
    data = _call("GET", "/v1/report", params={"period": period, "by": by, "format": "json"})
    if format == "json":
        typer.echo(json.dumps(data, indent=2))
        return
    from scheduler_service.budget.report import csv_from_json

    typer.echo(csv_from_json(data), nl=False)


@app.command()
def logs(
    job_id: Annotated[int, typer.Argument(min=1)],
    rank: Annotated[
        int,
        typer.Option(help="The worker at this rank (newest layout, else its last holder).", min=0),
    ] = 0,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new output until the job ends.")
    ] = False,
    scalars: Annotated[
        bool, typer.Option(help="The job's greenflow_log() numbers (JSON lines) instead.")
    ] = False,
) -> None:
    """Print a job's output: stdout/stderr of one worker, kept by the agent of its node."""
    import sys
    import time

    stream = "scalars" if scalars else "output"
    offset = 0
    while True:
        chunk = _call(
            "GET",
            f"/v1/jobs/{job_id}/logs",
            params={"rank": rank, "stream": stream, "offset": offset},
        )
        if chunk["skipped_bytes"]:
            err.print(f"[dim]... {chunk['skipped_bytes']} bytes dropped by the agent's cap[/dim]")
        if chunk["text"]:
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
        offset = chunk["next_offset"]
        if chunk["text"]:
            continue  # more may be waiting beyond this chunk
        if not follow or _call("GET", f"/v1/jobs/{job_id}")["state"] in TERMINAL:
            # One last read: output written just before the job ended.
            if follow:
                last = _call(
                    "GET",
                    f"/v1/jobs/{job_id}/logs",
                    params={"rank": rank, "stream": stream, "offset": offset},
                )
                sys.stdout.write(last["text"])
            return
        time.sleep(1.0)


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
    example: Annotated[
        Path | None,
        typer.Option(
            help="Also run a user job directory (job.yaml + its module, e.g. "
            "examples/hf_causal_lm), uploaded as a workdir bundle.",
            file_okay=False,
            exists=True,
        ),
    ] = None,
) -> None:
    """Run the scheduler, a local agent with simulated GPUs and a compressed carbon day; submit example jobs."""
    from scheduler_service.demo import run_demo, summary_line

    try:
        summary = run_demo(
            duration_s=duration,
            port=port,
            gpus=gpus,
            budget_kg=budget_kg,
            workdir=workdir,
            example=example,
        )
    except RuntimeError as exc:
        fail(str(exc))
    print(summary_line(summary))


def main() -> None:
    """Entry point of the `greenflow` script."""
    from worker_agent.cli import run_app

    run_app(app)


if __name__ == "__main__":
    main()
