"""`greenflow agent`: run the worker agent of one node (real GPUs or simulated CPU slots).

The scheduler's CLI registers `agent` as a command; `python -m worker_agent.cli` runs it alone.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from worker_agent.protocol import GpuSlotInfo

if TYPE_CHECKING:
    from worker_agent.telemetry import NvmlMeter

USAGE_ERROR = 2
NAME_PATTERN = r"[A-Za-z0-9_.-]{1,100}"

log = logging.getLogger("greenflow.agent")


def _fail(message: str) -> NoReturn:
    """One-line error on stderr, exit code 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(USAGE_ERROR)


def run_app(typer_app: typer.Typer) -> NoReturn:
    """Run a CLI app (`greenflow`, the agent); a usage error is one plain line and exit code 2."""
    try:
        result = typer.main.get_command(typer_app).main(standalone_mode=False)
    except typer.TyperException as exc:
        # Typer draws usage errors in a wrapped rich box that scripts cannot grep; the message
        # itself names the option and the problem.
        message = exc.format_message()
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        if message:  # empty after `no_args_is_help` printed the help
            typer.echo(f"error: {message}{hint}", err=True)
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        typer.echo("aborted", err=True)
        raise SystemExit(1) from None
    raise SystemExit(result if isinstance(result, int) else 0)


def _default_name() -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:100]
    return name or "agent"


def _real_gpu_slots(gpus: int) -> tuple[list[GpuSlotInfo], str, NvmlMeter | None]:
    """Slots for the first `gpus` CUDA devices; refuses if fewer are present."""
    import torch

    from worker_agent.telemetry import NvmlMeter, NvmlUnavailable

    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if present < gpus:
        _fail(f"--gpus {gpus}: only {present} CUDA device(s) present; use --simulate-gpus N")
    try:
        nvml: NvmlMeter | None = NvmlMeter()
    except NvmlUnavailable as exc:
        log.warning("%s: power will be estimated, not measured", exc)
        nvml = None
    slots: list[GpuSlotInfo] = []
    kind = torch.cuda.get_device_name(0)
    for i in range(gpus):
        if nvml is not None:
            kind, uuid, memory_mb = nvml.describe(i)
            slots.append(GpuSlotInfo(index=i, uuid=uuid, memory_mb=memory_mb))
        else:
            props = torch.cuda.get_device_properties(i)
            slots.append(GpuSlotInfo(index=i, memory_mb=int(props.total_memory // 2**20)))
    return slots, kind[:64], nvml


def agent(
    scheduler: Annotated[str, typer.Option(help="Scheduler base URL, e.g. http://127.0.0.1:8000.")],
    token: Annotated[
        str,
        typer.Option(help="Agent API token (role agent).", envvar="GREENFLOW_AGENT_TOKEN"),
    ],
    gpus: Annotated[
        int | None, typer.Option(help="Offer this many real CUDA GPUs (0..N-1).")
    ] = None,
    simulate_gpus: Annotated[
        int | None,
        typer.Option(help="Offer this many simulated GPU slots (CPU worker processes)."),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Node name (default: the host name).")] = None,
    host: Annotated[str, typer.Option(help="Address the agent API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the agent API (0 = a free port).")] = 0,
    advertise_url: Annotated[
        str | None,
        typer.Option(help="URL the scheduler should call (default: http://HOST:PORT)."),
    ] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            help="Directory every agent can read (shared storage) for job checkpoints, so a job"
            " resumes where it was when its node is lost; unset: it restarts from step 0.",
            envvar="GREENFLOW_CHECKPOINT_DIR",
        ),
    ] = None,
    checkpoint_interval_s: Annotated[
        float, typer.Option(help="Seconds between checkpoints of a running job.")
    ] = 300.0,
) -> None:
    """Run a worker agent: register with the scheduler and run the jobs it places here."""
    if (gpus is None) == (simulate_gpus is None):
        _fail("give exactly one of --gpus N or --simulate-gpus N")
    count = gpus if gpus is not None else simulate_gpus
    assert count is not None
    if not 1 <= count <= 1024:
        _fail(f"the GPU count must be between 1 and 1024, got {count}")
    if not re.fullmatch(r"https?://\S+", scheduler):
        _fail(f"--scheduler must be an http(s):// URL, got {scheduler!r}")
    if not token.strip():
        _fail("--token must not be empty")
    node = name or _default_name()
    if not re.fullmatch(NAME_PATTERN, node):
        _fail(f"--name {node!r}: use 1-100 letters, digits, '_', '.', '-'")
    if not 0 <= port <= 65535:
        _fail(f"--port must be 0..65535, got {port}")
    if advertise_url is not None and not re.fullmatch(r"https?://\S+", advertise_url):
        _fail(f"--advertise-url must be an http(s):// URL, got {advertise_url!r}")
    if not checkpoint_interval_s > 0:
        _fail(f"--checkpoint-interval-s must be > 0, got {checkpoint_interval_s}")
    if checkpoint_dir is not None:
        try:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _fail(f"--checkpoint-dir {checkpoint_dir}: {exc}")
        if not os.access(checkpoint_dir, os.W_OK):
            _fail(f"--checkpoint-dir {checkpoint_dir}: not writable")

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Imported only now: torch and the runtime take seconds to load, input errors should not wait.
    from worker_agent.agent import AgentConfig, serve

    # One line per scheduler request would drown the agent's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    nvml: NvmlMeter | None = None
    if gpus is not None:
        slots, kind, nvml = _real_gpu_slots(gpus)
        simulated = False
    else:
        slots = [GpuSlotInfo(index=i) for i in range(count)]
        kind, simulated = "simulated", True
    config = AgentConfig(
        scheduler_url=scheduler,
        token=token,
        name=node,
        slots=slots,
        simulated=simulated,
        gpu_kind=kind,
        host=host,
        port=port,
        advertise_url=advertise_url,
        checkpoint_dir=checkpoint_dir,
        checkpoint_interval_s=checkpoint_interval_s,
    )
    try:
        fatal = serve(config, nvml)
    except OSError as exc:
        _fail(f"cannot listen on {host}:{port}: {exc}")
    if fatal is not None:
        _fail(fatal)


def main() -> None:
    """Run `agent` as a stand-alone command."""
    run_app(_app())


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(agent)
    return app


if __name__ == "__main__":
    main()
