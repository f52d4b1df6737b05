"""Client commands and the API start without the heavy libraries (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Modules that take seconds to load: the simulator and solver stack, and torch.
HEAVY = (
    "torch",
    "ortools",
    "scipy",
    "pandas",
    "scheduler_service.simulate",
    "scheduler_service.allocation",
)


def _loaded_after(statement: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has loaded after running `statement`."""
    code = f"import json, sys\n{statement}\nprint(json.dumps([m for m in {list(modules)!r} if m in sys.modules]))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded: list[str] = json.loads(result.stdout.splitlines()[-1])
    return loaded


def test_cli_module_loads_no_heavy_library() -> None:
    assert _loaded_after("import scheduler_service.cli", HEAVY) == []


def test_cli_module_loads_neither_database_nor_settings() -> None:
    # A client command needs only httpx: not the ORM, not the carbon providers behind the settings.
    modules = ("sqlalchemy", "fastapi", "scheduler_service.settings", "numpy")
    assert _loaded_after("import scheduler_service.cli", modules) == []


@pytest.mark.parametrize("command", ["simulate", "agent"])
def test_lazy_commands_load_when_run(command: str) -> None:
    statement = (
        "from typer.main import get_command\n"
        "import scheduler_service.cli as cli\n"
        "group = get_command(cli.app)\n"
        f"assert {command!r} in group.list_commands(None)\n"
        f"assert group.get_command(None, {command!r}) is not None"
    )
    module = "scheduler_service.simulate.cli" if command == "simulate" else "worker_agent.cli"
    assert _loaded_after(statement, (module,)) == [module]


def test_app_module_loads_no_torch() -> None:
    # The API imports the model types; the fits load scipy's optimiser when the loop first fits.
    assert _loaded_after("import scheduler_service.app", ("torch",)) == []


def test_fitting_a_job_model_needs_no_torch() -> None:
    # The scheduler fits every job's model from telemetry; torch is the agents' (training) only.
    statement = (
        "from datetime import UTC, datetime\n"
        "from energy_model.job_model import JobModelFitter, TelemetryPoint, prior_job_model\n"
        "fitter = JobModelFitter(prior_job_model('resnet50', 256, (1, 2, 4)))\n"
        "point = TelemetryPoint(gpus=2, samples_per_s=900.0, power_w=500.0, at=datetime.now(UTC))\n"
        "model = fitter.update([point])\n"
        "assert model.throughput_samples_per_s[2] != fitter.prior.throughput_samples_per_s[2]"
    )
    assert _loaded_after(statement, ("torch", "scipy.optimize")) == ["scipy.optimize"]


def test_app_module_loads_no_ortools_pandas_or_scipy() -> None:
    # OR-Tools' model builder (and pandas behind it) and scipy.sparse load at the first solve, in
    # the loop's thread, so `greenflow serve` answers /healthz without waiting for them.
    modules = ("ortools", "pandas", "scipy")
    assert _loaded_after("import scheduler_service.app", modules) == []


def test_building_a_model_loads_scipy() -> None:
    # The lazy import is really taken when a model is built (not left out altogether).
    statement = (
        "from scheduler_service.allocation.model import _Rows\n"
        "import numpy as np\n"
        "rows = _Rows()\n"
        "start = rows.block(1, 0.0, 1.0)\n"
        "rows.add(np.array([start]), np.array([0]), 1.0)\n"
        "assert rows.matrix(1).shape == (1, 1)"
    )
    assert _loaded_after(statement, ("scipy.sparse",)) == ["scipy.sparse"]
