"""docker-compose.yml: every service command is one the `greenflow` CLI accepts."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import typer
import yaml

from scheduler_service.cli import app

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _greenflow_commands(command: list[str] | str) -> list[list[str]]:
    """The greenflow invocations in a service command (a list, or `sh -c "a && b && exec c"`)."""
    if isinstance(command, str):
        command = shlex.split(command)
    if command[:2] == ["sh", "-c"]:
        found = []
        for part in command[2].split("&&"):
            words = shlex.split(part)
            if words and words[0] == "exec":
                words = words[1:]
            if words and words[0] == "greenflow":
                found.append(words[1:])
        return found
    return [command[1:]] if command and command[0] == "greenflow" else []


def _parse(args: list[str]) -> str:
    """Parse `greenflow ARGS` with the real CLI without running it; return the command path."""
    group = typer.main.get_command(app)
    ctx = group.make_context("greenflow", list(args), resilient_parsing=False)
    path = ["greenflow"]
    # Typer bundles its own click: recognise groups by what they can do.
    while hasattr(ctx.command, "resolve_command"):
        name, sub, rest = ctx.command.resolve_command(
            ctx, [*getattr(ctx, "_protected_args", []), *ctx.args]
        )
        assert sub is not None, f"unknown command {name}"
        path.append(sub.name or "")
        ctx = sub.make_context(sub.name, rest, parent=ctx)
    return " ".join(path)


def test_every_service_runs_a_command_the_cli_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GREENFLOW_AGENT_TOKEN", "gf_0123456789abcdef_" + "x" * 43)
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {"postgres", "scheduler", "agent-1", "agent-2"} <= set(services)
    seen = []
    for name, service in services.items():
        if "command" not in service:
            continue
        for args in _greenflow_commands(service["command"]):
            seen.append((name, _parse(args)))
    assert ("scheduler", "greenflow db upgrade") in seen
    assert ("scheduler", "greenflow token create") in seen
    assert ("scheduler", "greenflow serve") in seen
    assert ("agent-1", "greenflow agent") in seen
    assert ("agent-2", "greenflow agent") in seen


def test_a_wrong_option_is_caught() -> None:
    with pytest.raises(Exception, match="No such option"):
        _parse(
            [
                "agent",
                "--scheduler",
                "http://x:1",
                "--token",
                "t",
                "--simulate-gpus",
                "2",
                "--bogus",
            ]
        )
