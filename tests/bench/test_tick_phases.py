"""bench.tick_phases runs a few ticks on a tiny cluster and reports every phase of each."""

from __future__ import annotations

import argparse

from bench.tick_phases import run
from tests.api.conftest import database_url, postgres_server  # noqa: F401


def test_tick_phases_reports_each_tick_after_acks_telemetry_and_more_jobs(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    args = argparse.Namespace(
        jobs=6, nodes=1, gpus=4, ticks=2, more_jobs=2, telemetry_rounds=1, profile=""
    )
    first, second = run(args, database_url)
    assert (first["jobs_planned"], second["jobs_planned"]) == (6, 8)
    # The first plan sent commands; all were acknowledged, and the jobs running reported.
    assert first["commands"] > 0 and first["acknowledged_after"] == first["commands"]
    assert first["samples_after"] > 0
    for tick in (first, second):
        assert tick["statements"] > 0
        for phase in ("snapshot", "models", "write"):
            # The tick thread's CPU is part of the phase's time (rounded to ms: slack).
            assert 0 <= tick[f"{phase}_cpu_s"] <= tick[f"{phase}_s"] + 0.002
