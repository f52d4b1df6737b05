"""The budget watchdog with real processes: a grid that turns dirty mid-slot stops a job long
before the next tick would have.

A PostgreSQL-backed uvicorn scheduler and one agent with one simulated GPU; a carbon trace on a
compressed clock (one trace hour = 10 s) that is clean for its first 10 replayed hours and then
far dirtier than any real grid. The forecast is the model's (from a clean past), so the tick that
starts the job plans a whole 600 s slot as clean. When the grid turns, the ledger passes the
hard budget within seconds; the watchdog, checking every 2 s, sees the spend run far ahead of
the plan and wakes the planner, which pauses the job, within the budget. Without it the job would run until the next tick, about 600 s after the last.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.test_end_to_end import (
    Stack,
    describe,
    stack,  # noqa: F401 (fixture)
    wait_until,
    write_hourly_trace,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(600)]

TRACE_HOUR_S = 10.0
CLEAN_HOURS = 10  # replayed clean hours: 100 s of wall clock to get the job running
BUDGET_KG = 0.01  # one simulated GPU in the dirty hours spends it in about 20 s

CONFIG = """\
[budget]
period = "day"
limit_kg_co2e = {budget_kg}
enforcement = "hard"
[carbon]
provider = "trace"
region = "watchdog"
trace_path = "{trace}"
clock_speedup = {speedup}
forecast_mode = "model"
conservative_intensity_g_per_kwh = 5000
[planner]
slot_s = 600
horizon_s = 600
solver_time_limit_s = 2.0
budget_check_interval_s = 2
[cluster]
pue = 1.2
heartbeat_timeout_s = 30
agent_heartbeat_interval_s = 1
agent_telemetry_interval_s = 1
# The hard budget here is sized for what the jobs draw: the nodes' idle-GPU and host draw until
# the day's end (charged, and reserved by the planner: tests/budget/test_node_power.py) would
# take all of it, so the node model is zero and the budget measures the planner and watchdog.
idle_power_per_gpu_w = 0
host_power_w = 0
"""


def test_watchdog_pauses_a_job_when_the_grid_turns_dirty_mid_slot(stack: Stack) -> None:  # noqa: F811
    trace = stack.tmp / "watchdog-trace.csv"
    # Hours 0-59 are the forecaster's (clean) past; the replay stays clean for CLEAN_HOURS more.
    write_hourly_trace(trace, lambda hour: 5.0 if hour < 60 + CLEAN_HOURS else 5000.0)
    (stack.tmp / "greenflow.toml").write_text(
        CONFIG.format(budget_kg=BUDGET_KG, trace=trace, speedup=3600 / TRACE_HOUR_S)
    )
    # The replay's clock starts when the scheduler creates its provider, just before it answers.
    stack.start_scheduler()
    started_at = time.monotonic()
    stack.start_agent("node-a", 1)
    wait_until("the node", lambda: len(stack.get("/v1/nodes")) == 1, 90, stack)
    spec = {
        "name": "long",
        "workload": "gpt-tiny",
        "global_batch_size": 16,
        "total_samples": 50_000_000,
        "min_gpus": 1,
        "max_gpus": 1,
    }
    job_id = stack.api.post("/v1/jobs", json=spec).json()["id"]

    def job_state() -> str:
        return str(stack.get(f"/v1/jobs/{job_id}")["state"])

    wait_until("the job running", lambda: job_state() == "RUNNING", 100, stack)
    if time.monotonic() - started_at > CLEAN_HOURS * TRACE_HOUR_S - 10:
        pytest.fail(
            "the job started too late (the grid was about to turn dirty): machine overloaded"
        )

    # The grid turns dirty: the measured spend runs far ahead of the plan (and would pass the
    # budget in about 20 s), so the watchdog wakes the planner, which pauses the job.
    dirty_at = started_at + CLEAN_HOURS * TRACE_HOUR_S
    wait_until("the job paused", lambda: job_state() in {"QUEUED", "DEFERRED"}, 300, stack)
    stopped_after_dirty_s = time.monotonic() - dirty_at
    log = (stack.tmp / "scheduler.log").read_text()
    assert "budget watchdog" in log, log[-3000:]
    # Long before the next regular tick (600 s after the one that started the job).
    assert stopped_after_dirty_s < 150, stopped_after_dirty_s
    # Paused for want of budget, not gone, and what it spent is on the ledger.
    assert job_state() in {"QUEUED", "DEFERRED"}, describe(stack)

    # The hard budget held: once the run's last telemetry is charged (the spend stays put over
    # a check and a report), what it spent is within the budget.
    readings: list[float] = []

    def spend_settled() -> bool:
        readings.append(float(stack.get("/v1/budget")["periods"][0]["spent_kg_co2e"]))
        return len(readings) >= 4 and readings[-1] == readings[-4]

    wait_until("the spend settled", spend_settled, 30, stack)
    assert 0 < readings[-1] <= BUDGET_KG, readings
