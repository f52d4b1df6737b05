"""`greenflow demo --duration S`: the README's first command runs the whole stack and summarises it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.processes import free_port, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_demo_runs_jobs_and_prints_a_json_summary_last(tmp_path: Path) -> None:
    result = run_cli(
        ["demo", "--duration", "60", "--port", str(free_port()), "--workdir", str(tmp_path)],
        env={},
        timeout_s=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(summary) == {
        "jobs",
        "completed",
        "hot_switches",
        "energy_kwh",
        "emissions_kg",
        "budget_kg",
    }
    assert summary["jobs"] == 3
    assert summary["energy_kwh"] > 0
    assert 0 < summary["emissions_kg"] <= summary["budget_kg"]
    assert "allocation" in result.stdout  # allocation changes are printed as they happen
    # Its budget is sized for its jobs: nothing is paused for it (a node model charging idle
    # GPUs and a host for the rest of a wall-clock day once paused every job after 6 s).
    assert "budget of this period is spent" not in result.stdout
    assert (tmp_path / "greenflow-demo.db").exists()
