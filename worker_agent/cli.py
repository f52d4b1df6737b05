"""`greenflow agent`: run the worker agent of one node (real GPUs or simulated CPU slots).

The scheduler's CLI registers `agent` as a command; `python -m worker_agent.cli` runs it alone.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn
from urllib.parse import urlsplit

import typer

from worker_agent.bundle import DEFAULT_CACHE_MAX_BYTES
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


def default_checkpoint_dir() -> Path:
    """Where checkpoints go unless configured: the user's data directory (XDG)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "greenflow" / "checkpoints"


def default_export_dir() -> Path:
    """Where finished jobs are exported unless configured: the user's data directory (XDG)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "greenflow" / "exports"


def _default_name() -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:100]
    return name or "agent"


def _is_loopback_or_any(address: str) -> bool:
    if address in ("", "localhost"):
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def rendezvous_address(option: str, host: str, scheduler_url: str) -> str | None:
    """The address other nodes reach this node on (None: jobs stay inside this node).

    `option` "none": None. An address: that address. "auto": `host` when the API listens on one
    specific non-loopback address; else, when the scheduler is reached over loopback (the whole
    cluster is this machine), None; else the address this machine sends from toward the
    scheduler (the interface of the route to it), unless that is loopback too.
    """
    if option == "none":
        return None
    if option != "auto":
        return option
    if not _is_loopback_or_any(host):
        return host
    target = urlsplit(scheduler_url)
    target_host = target.hostname or ""
    try:
        infos = socket.getaddrinfo(target_host, target.port or 80, socket.AF_INET)
    except OSError:
        return None
    if not infos or ipaddress.ip_address(infos[0][4][0]).is_loopback:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(infos[0][4])  # UDP: picks the route, sends nothing
        except OSError:
            return None
        mine = str(probe.getsockname()[0])
    return None if _is_loopback_or_any(mine) else mine


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
        str | None,
        typer.Option(
            help="This node's credential (`greenflow node enrol NAME`); prefer the environment "
            "variable or --token-file: a command line is visible to every user (ps).",
            envvar="GREENFLOW_AGENT_TOKEN",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding this node's credential (e.g. a mounted secret).",
            envvar="GREENFLOW_AGENT_TOKEN_FILE",
        ),
    ] = None,
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
    rendezvous_host: Annotated[
        str,
        typer.Option(
            help="Address the other nodes reach this node on, for jobs across nodes (their "
            "rendezvous store, this node's worker host): an address, 'none' (jobs stay inside "
            "this node) or 'auto' (--host when it is one non-loopback address; else the address "
            "this machine reaches the scheduler from; none when that is loopback).",
            envvar="GREENFLOW_RENDEZVOUS_HOST",
        ),
    ] = "auto",
    worker_host_port: Annotated[
        int,
        typer.Option(help="Port of this node's worker host on the rendezvous address (0 = free)."),
    ] = 0,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            help="Directory every agent can read (shared storage) for job checkpoints, so a job"
            " resumes where it was when its node is lost (default: "
            "$XDG_DATA_HOME/greenflow/checkpoints, i.e. shared by the agents of one machine).",
            envvar="GREENFLOW_CHECKPOINT_DIR",
        ),
    ] = None,
    checkpoints: Annotated[
        bool,
        typer.Option(
            help="Checkpoint running jobs periodically (--no-checkpoints: a job whose node is "
            "lost restarts from step 0)."
        ),
    ] = True,
    checkpoint_interval_s: Annotated[
        float, typer.Option(help="Seconds between checkpoints of a running job.")
    ] = 300.0,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="The agent's own files: the cache of jobs' workdir bundles and the jobs' output "
            "(default: a new temporary directory, removed when the agent stops).",
            envvar="GREENFLOW_AGENT_DATA_DIR",
        ),
    ] = None,
    export_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where finished module jobs are exported (job-<id>/model.safetensors, "
            "config.json; a later job of the same id replaces it); default "
            "$XDG_DATA_HOME/greenflow/exports.",
            envvar="GREENFLOW_EXPORT_DIR",
        ),
    ] = None,
    bundle_cache_bytes: Annotated[
        int,
        typer.Option(
            min=1 << 20,
            help="Cap on the unpacked workdir bundles cached in --data-dir; the least recently "
            "used go first, never one a job here uses.",
        ),
    ] = DEFAULT_CACHE_MAX_BYTES,
    dcgm_url: Annotated[
        str | None,
        typer.Option(
            help="A DCGM exporter's metrics URL (e.g. http://127.0.0.1:9400/metrics) to read GPU"
            " power from where NVML is not used.",
            envvar="GREENFLOW_DCGM_URL",
        ),
    ] = None,
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
    if (token is None) == (token_file is None):
        _fail("give the node's credential once: GREENFLOW_AGENT_TOKEN, --token-file or --token")
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            _fail(f"--token-file {token_file}: cannot read it ({exc})")
    assert token is not None
    if not token.strip():
        _fail("the agent token must not be empty")
    node = name or _default_name()
    if not re.fullmatch(NAME_PATTERN, node):
        _fail(f"--name {node!r}: use 1-100 letters, digits, '_', '.', '-'")
    if not 0 <= port <= 65535:
        _fail(f"--port must be 0..65535, got {port}")
    if not 0 <= worker_host_port <= 65535:
        _fail(f"--worker-host-port must be 0..65535, got {worker_host_port}")
    if rendezvous_host not in ("auto", "none") and not re.fullmatch(
        r"[A-Za-z0-9.:_-]{1,253}", rendezvous_host
    ):
        _fail(f"--rendezvous-host must be an address, 'auto' or 'none', got {rendezvous_host!r}")
    rendezvous = rendezvous_address(rendezvous_host, host, scheduler)
    if advertise_url is not None and not re.fullmatch(r"https?://\S+", advertise_url):
        _fail(f"--advertise-url must be an http(s):// URL, got {advertise_url!r}")
    if not checkpoint_interval_s > 0:
        _fail(f"--checkpoint-interval-s must be > 0, got {checkpoint_interval_s}")
    if not checkpoints and checkpoint_dir is not None:
        _fail("give either --checkpoint-dir or --no-checkpoints, not both")
    if checkpoints and checkpoint_dir is None:
        checkpoint_dir = default_checkpoint_dir()
    if export_dir is None:
        export_dir = default_export_dir()
    for option, directory in (
        ("--checkpoint-dir", checkpoint_dir),
        ("--data-dir", data_dir),
        ("--export-dir", export_dir),
    ):
        if directory is None:
            continue
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _fail(f"{option} {directory}: {exc}")
        if not os.access(directory, os.W_OK):
            _fail(f"{option} {directory}: not writable")

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Imported only now: torch and the runtime take seconds to load, input errors should not wait.
    from worker_agent.agent import AgentConfig
    from worker_agent.api import serve

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
        rendezvous_host=rendezvous,
        worker_host_port=worker_host_port,
        checkpoint_dir=checkpoint_dir,
        checkpoint_interval_s=checkpoint_interval_s,
        data_dir=data_dir,
        export_dir=export_dir,
        bundle_cache_max_bytes=bundle_cache_bytes,
        dcgm_url=dcgm_url,
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
