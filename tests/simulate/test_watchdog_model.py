"""The simulator's realistic budget watchdog (`--watchdog-*`) against hand-computed toy replays.

One job on one GPU at a constant 100 g/kWh (PUE 1) spends r = P x 100 / 3.6e9 kg/s, so every
spend below is r times a number of seconds. The default (ideal) watchdog must not move.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from energy_model.carbon.series import IntensitySeries, load_intensity_csv
from energy_model.profiles import ScalingProfile, load_scaling_profiles
from scheduler_service.simulate import engine
from scheduler_service.simulate.cli import simulate
from scheduler_service.simulate.engine import (
    SimulationConfig,
    SimulationError,
    SimulationReport,
    WatchdogModel,
    simulate_trace,
)
from scheduler_service.simulate.trace import JobTables, TraceJob, job_tables, load_trace
from tests.simulate.test_simulate import write_profiles, write_series, write_trace

# 10,000 s of work on its one allowed GPU: it never finishes inside these replays' budgets.
SOLO_JOB = "a,0,100000,solo,,32,1,10000"


def _solo(
    tmp_path: Path,
) -> tuple[list[TraceJob], dict[str, ScalingProfile], IntensitySeries, float]:
    """(jobs, profiles, series, r): one 1-GPU job, 100 g/kWh flat, r its real kg per second."""
    folder = tmp_path / "solo_profiles"
    folder.mkdir()
    (folder / "solo.csv").write_text("global_batch_size,1\n32,10\n")
    profiles = load_scaling_profiles(folder)
    series = load_intensity_csv(write_series(tmp_path, [100.0] * 48))
    jobs = load_trace(write_trace(tmp_path, [SOLO_JOB]))
    power_w = job_tables(jobs[0], profiles, 1).power_w[0]
    return jobs, profiles, series, power_w * 100.0 / 3.6e9


def _config(budget_kg: float, slot_s: float, watchdog: WatchdogModel | None) -> SimulationConfig:
    return SimulationConfig(
        policy="static",
        num_nodes=1,
        gpus_per_node=1,
        slot_s=slot_s,
        horizon_slots=4,
        budget_kg=budget_kg,
        budget_period="run",
        switch_cost="flat",
        watchdog=watchdog,
    )


def test_the_lead_stops_the_job_early_and_leaves_budget_unspent(tmp_path: Path) -> None:
    jobs, profiles, series, r = _solo(tmp_path)
    # The budget pays for exactly two 900 s slots (a hair over, so the plan books both).
    budget_kg = r * 1800.0 * (1 + 1e-6)
    ideal = simulate_trace(jobs, series, profiles, _config(budget_kg, 900.0, None))
    # No model or forecast error: the plan is right, the ideal watchdog never cuts, and the job
    # runs its two slots, spending the budget.
    assert ideal.emissions_kg == pytest.approx(r * 1800.0, rel=1e-9)
    assert ideal.budget_cuts == 0 and ideal.budget_violations == 0
    model = WatchdogModel(check_interval_s=60.0, telemetry_interval_s=5.0, tick_s=2.0)
    real = simulate_trace(jobs, series, profiles, _config(budget_kg, 900.0, model))
    # Lead 60 + 5 + 2 = 67 s. At the check at c the ledger holds the spend to c - 5 s and the
    # rate r, so the watchdog wakes at the first check with (c - 5) + 67 >= 1800.0018: c = 1740
    # (1680 gives 1742). The stop takes effect 2 s later: the job ran 1,742 s, and the plan made
    # then sees 58 s of budget, less than a slot of the job, so it stops the job.
    assert real.emissions_kg == pytest.approx(r * 1742.0, rel=1e-9)
    assert real.outcomes[0].energy_kwh == pytest.approx(
        ideal.outcomes[0].energy_kwh * 1742.0 / 1800.0, rel=1e-9
    )
    assert real.budget_cuts == 1 and real.budget_violations == 0
    assert real.budget_overshoot_kg == 0.0
    # The price: the budget left unspent, about one lead's worth less the last check's gap.
    assert budget_kg - real.emissions_kg == pytest.approx(r * 58.0018, rel=1e-6)
    assert real.unfinished == 1


@pytest.mark.parametrize(
    ("tick_s", "stop_s"),
    [
        (2.0, 62.0),  # the stop lands before the crossing at 75 s: no overspend
        (30.0, 90.0),  # a slow tick: the job runs 15 s past the crossing
    ],
)
def test_tick_latency_can_make_the_realistic_watchdog_overspend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tick_s: float, stop_s: float
) -> None:
    jobs, profiles, series, r = _solo(tmp_path)
    new_state = engine._new_state

    def quarter_power(*args: object, **kwargs: object) -> engine._JobState:
        # The policy's model of the job says a quarter of the power it really draws.
        state = new_state(*args, **kwargs)  # type: ignore[arg-type]
        seen = state.seen
        state.seen = JobTables(
            seen.allowed_gpus, seen.throughput_samples_per_s, tuple(p / 4 for p in seen.power_w)
        )
        return state

    monkeypatch.setattr(engine, "_new_state", quarter_power)
    # One 300 s slot as the policy sees it (r / 4 x 300 s = 75 r): the real spend crosses at 75 s.
    budget_kg = r * 75.0 * (1 + 1e-6)
    ideal = simulate_trace(jobs, series, profiles, _config(budget_kg, 300.0, None))
    # The ideal watchdog cuts the step exactly at the crossing.
    assert ideal.emissions_kg == pytest.approx(budget_kg, rel=1e-9)
    assert ideal.budget_cuts == 1 and ideal.budget_violations == 0
    model = WatchdogModel(check_interval_s=60.0, telemetry_interval_s=5.0, tick_s=tick_s)
    real = simulate_trace(jobs, series, profiles, _config(budget_kg, 300.0, model))
    # The check at 0 s has no telemetry yet. At 60 s the ledger holds 55 r against the 15 r the
    # plan expected by then, and 55 r + the lead's worth is past the budget: the watchdog wakes
    # (with the 2 s tick by the lead rule, 55 r + 67 r >= 75 r; with the 30 s tick the lead,
    # 95 s, is longer than the plan's whole budget lasts, so that rule stays quiet for this plan,
    # and the spend running 3.7x ahead of the plan wakes it). The stop takes effect tick_s
    # later; the next plan sees the budget spent and runs nothing.
    assert real.emissions_kg == pytest.approx(r * stop_s, rel=1e-9)
    assert real.budget_cuts == 1
    overshoot = max(0.0, r * stop_s - budget_kg)
    assert real.budget_overshoot_kg == pytest.approx(overshoot, rel=1e-6, abs=1e-12)
    assert real.budget_violations == (1 if overshoot > 1e-6 else 0)
    assert (real.budget_violations == 1) == (tick_s == 30.0)


def test_a_step_is_charged_to_one_period_and_cut_at_its_end(tmp_path: Path) -> None:
    jobs, profiles, series, r = _solo(tmp_path)
    # A daily budget: the replay goes on into the days after the trace's span.
    config = replace(
        _config(r * 1800.0 * (1 + 1e-6), 900.0, WatchdogModel(60.0, 5.0, 2.0)),
        budget_period="day",
    )
    report = simulate_trace(jobs, series, profiles, config)
    # Each day the job runs 1,742 s, until the watchdog stops it 58 s short of the day's budget
    # (the checks fall on the day's start, 86,400 s being a multiple of 60), then waits for the
    # next day, where it restarts (a 30 s switch at full power, no progress): 1,742 s of work on
    # day one, 1,712 s on days two to five, the last 1,410 s (+ 30 s) on day six. No day
    # overspends; a step never runs across a day's end.
    assert report.finished == 1 and report.budget_violations == 0
    assert report.budget_periods_after_span == 5
    assert report.emissions_kg == pytest.approx(r * (5 * 1742.0 + 1440.0), rel=1e-9)
    assert report.budget_cuts == 5


# The default (ideal) watchdog's report on the hard-budget case with model and forecast error,
# as the code before the realistic model gave it (solver times left out).
GOLDEN = {
    "static": {
        "avg_jct_s": 88330.0,
        "p95_jct_s": 173610.0,
        "energy_kwh": 3.9928262348223926,
        "emissions_kg": 1.1206421847443429,
        "budget_allowance_kg": 1.222699486016152,
        "budget_periods_after_span": 2,
        "budget_violations": 0,
        "budget_overshoot_kg": 0.0,
        "budget_cuts": 1,
        "gpu_changes": 2,
        "ticks": 202,
        "makespan_s": 177360.0,
    },
    "carbon-greedy": {
        "avg_jct_s": 584704.7788993167,
        "p95_jct_s": 621376.3759036667,
        "energy_kwh": 3.9352175019302225,
        "emissions_kg": 0.7251861878561419,
        "budget_allowance_kg": 0.7635004418345814,
        "budget_periods_after_span": 7,
        "budget_violations": 0,
        "budget_overshoot_kg": 0.0,
        "budget_cuts": 5,
        "gpu_changes": 23,
        "ticks": 699,
        "makespan_s": 623596.5774418667,
    },
}


@pytest.mark.parametrize("policy", sorted(GOLDEN))
def test_the_default_ideal_watchdog_report_is_unchanged(tmp_path: Path, policy: str) -> None:
    profiles = load_scaling_profiles(write_profiles(tmp_path))
    series = load_intensity_csv(write_series(tmp_path, [400.0, 50.0, 250.0, 120.0] * 12))
    rows = [f"j{i},{i * 600},{36000 * (1 + i % 3)},toy,,32,2,3600" for i in range(6)]
    jobs = load_trace(write_trace(tmp_path, rows))
    free = simulate_trace(
        jobs,
        series,
        profiles,
        # The golden figures were measured with the flat 30 s switch.
        SimulationConfig(policy=policy, num_nodes=1, gpus_per_node=4, switch_cost="flat"),
    )
    config = SimulationConfig(
        policy=policy,
        num_nodes=1,
        gpus_per_node=4,
        budget_kg=free.emissions_kg * 0.5,
        budget_period="day",
        horizon_slots=12,
        model_error=0.3,
        forecast_error=0.2,
        seed=0,
        # The forecast noise of that code: one draw per slot, the hour running now included.
        measured_now=False,
        switch_cost="flat",
    )
    assert config.watchdog is None
    report: SimulationReport = simulate_trace(jobs, series, profiles, config)
    summary = report.summary()
    for key, value in GOLDEN[policy].items():
        assert summary[key] == pytest.approx(value, rel=1e-9), key


def test_watchdog_model_validates_its_numbers() -> None:
    for bad in (
        {"check_interval_s": 0.0},
        {"telemetry_interval_s": -5.0},
        {"tick_s": math.nan},
        {"tick_s": math.inf},
    ):
        with pytest.raises(SimulationError, match="positive"):
            WatchdogModel(**bad)  # type: ignore[arg-type]
    with pytest.raises(SimulationError, match="needs a budget"):
        SimulationConfig("static", 1, 1, watchdog=WatchdogModel())
    # The service's defaults: a fifth of the slot within 1-300 s, 5 s reports, a 2 s tick.
    model = WatchdogModel()
    assert (model.check_s(300.0), model.check_s(900.0), model.check_s(3600.0)) == (60, 180, 300)
    assert (model.telemetry_interval_s, model.tick_s) == (5.0, 2.0)


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command(name="simulate")(simulate)
    app.command(name="noop")(lambda: None)  # a second command keeps `simulate` a subcommand
    return app


def test_cli_watchdog_flags(tmp_path: Path) -> None:
    profiles = write_profiles(tmp_path)
    carbon = write_series(tmp_path, [100.0, 300.0] * 12)
    trace = write_trace(tmp_path, ["a,0,36000,toy,,32,1,3600"])
    out = tmp_path / "report.json"
    base = [
        "simulate",
        *("--jobs", str(trace), "--carbon", str(carbon), "--profiles", str(profiles)),
        *("--cluster", "1x4", "--policy", "static", "--out", str(out)),
    ]
    runner = CliRunner()
    for flag, value in (
        ("--watchdog-check-s", "0"),
        ("--watchdog-telemetry-s", "-1"),
        ("--watchdog-tick-s", "nan"),
        ("--watchdog-check-s", "inf"),
    ):
        result = runner.invoke(_app(), [*base, "--budget-kg", "1", flag, value])
        assert result.exit_code == 2, (flag, value, result.output)
        assert flag in result.output and "positive" in result.output
        assert not out.exists()
    no_budget = runner.invoke(_app(), [*base, "--watchdog-tick-s", "2"])
    assert no_budget.exit_code == 2 and "--budget-kg" in no_budget.output
    assert not out.exists()
    # One flag turns the model on; the others take the service's defaults (slot 900 s: 180 s).
    ok = runner.invoke(_app(), [*base, "--budget-kg", "1", "--watchdog-tick-s", "3"])
    assert ok.exit_code == 0, ok.output
    config = json.loads(out.read_text())["config"]
    assert config["watchdog"] == {
        "check_interval_s": None,
        "telemetry_interval_s": 5.0,
        "tick_s": 3.0,
    }
    # Without the flags: the ideal watchdog, as before.
    out.unlink()
    ideal = runner.invoke(_app(), [*base, "--budget-kg", "1"])
    assert ideal.exit_code == 0, ideal.output
    assert json.loads(out.read_text())["config"]["watchdog"] is None
