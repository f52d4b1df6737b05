"""The schedule-quality bench's own arithmetic: the slack workload's bound and the frontier."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bench.schedule_quality import (
    dominated,
    job_options,
    main,
    pareto,
    slack_saving_bound,
    slack_trace,
)
from energy_model.carbon.series import IntensitySeries
from scheduler_service.simulate.engine import CarbonClock
from scheduler_service.simulate.trace import JobTables, TraceJob

T0 = datetime(2021, 1, 1, tzinfo=UTC)


def series(values: list[float]) -> IntensitySeries:
    times = tuple(T0 + timedelta(hours=i) for i in range(len(values)))
    return IntensitySeries(times, tuple(values), source="test")


def job(deadline_s: float | None, samples: int = 3600) -> TraceJob:
    return TraceJob("a", 0.0, samples, "toy", deadline_s, 1, 1, 3600.0)


# 1 sample/s at 100 W, or 2 samples/s at 300 W (1.5x the energy per sample).
TABLES = JobTables((1, 2), (1.0, 2.0), (100.0, 300.0))


def test_job_options_price_the_cleanest_hours_before_each_finish() -> None:
    clock = CarbonClock(series([500.0, 100.0, 500.0, 500.0]), pue=1.0)
    options = job_options(job(4 * 3600.0), clock, TABLES, 3600.0)
    # Finishing in the first hour: at least the fastest run's JCT (2 GPUs, 1,800 s), and at least
    # the kg of finishing by the hour's end (1 GPU for the whole hour at 500 g/kWh).
    assert options[0] == pytest.approx((1800.0, 100.0 * 3600 / 3.6e6 * 0.5))
    # By 2 h: every sample at 1 GPU inside the clean second hour.
    assert options[1] == pytest.approx((3600.0, 100.0 * 3600 / 3.6e6 * 0.1))
    # Later finishes can only be cheaper or equal, at a JCT no lower than the earlier grid point.
    assert [kg for _, kg in options] == sorted((kg for _, kg in options), reverse=True)


def test_job_options_run_one_count_at_a_time() -> None:
    # 3 h of work at 1 GPU, at most 2 h of it per hour (2 GPUs). It cannot finish in the first
    # hour, and finishing by 2 h or later costs 2 GPUs through the clean hour (0.3 kWh at 100 g)
    # plus 1 GPU through a dirty one (0.1 kWh at 500 g): 0.08 kg. The bound that let every count
    # use the whole hour side by side finished in the first hour and priced 2 h at 0.04 kg.
    clock = CarbonClock(series([500.0, 100.0, 500.0, 500.0]), pue=1.0)
    options = job_options(job(4 * 3600.0, samples=3 * 3600), clock, TABLES, 3600.0)
    assert [jct for jct, _ in options] == [5400.0, 7200.0, 10800.0]
    assert [kg for _, kg in options] == pytest.approx([0.3 * 0.1 + 0.1 * 0.5] * 3)


def test_slack_bound_shares_the_jct_allowance_between_jobs() -> None:
    # Two jobs, each: fast (1 h, 10 kg) or slow (2 h, 4 kg). 3 h in all allows one slow job.
    options = [[(3600.0, 10.0), (7200.0, 4.0)], [(3600.0, 10.0), (7200.0, 4.0)]]
    assert slack_saving_bound(options, 3 * 3600.0, 20.0) == pytest.approx(1 - 14.0 / 20.0, abs=1e-3)
    # With 4 h both run slow; with 2 h neither.
    assert slack_saving_bound(options, 4 * 3600.0, 20.0) == pytest.approx(1 - 8.0 / 20.0, abs=1e-3)
    assert slack_saving_bound(options, 2 * 3600.0, 20.0) == pytest.approx(0.0, abs=1e-3)


def test_frontier_domination_needs_as_good_a_figure_at_no_more_carbon() -> None:
    greenflow = [(0.62, 34.0), (0.60, 30.0)]
    assert dominated((0.62, 47.6), greenflow, higher_is_better=True)
    assert not dominated((0.63, 47.6), greenflow, higher_is_better=True)
    assert not dominated((0.50, 29.0), greenflow, higher_is_better=True)
    assert dominated((7000.0, 40.0), [(6000.0, 40.0)], higher_is_better=False)


def test_slack_trace_turns_a_seeded_share_into_windowed_best_effort_jobs() -> None:
    jobs = [TraceJob(str(i), float(i), 10, "toy", float(i) + 60.0, 1, 1, 6.0) for i in range(50)]
    out = slack_trace(jobs, 0.7, 86_400.0, seed=3)
    assert out == slack_trace(jobs, 0.7, 86_400.0, seed=3)
    windowed = [j for j in out if j.best_effort]
    assert 20 < len(windowed) < 50
    assert all(j.deadline_s == j.submission_s + 86_400.0 for j in windowed)
    assert all(j.deadline_s == j.submission_s + 60.0 for j in out if not j.best_effort)


DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _run_bench(
    args: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> dict[str, Any]:
    """The bench's JSON for `args` (command-line words)."""
    monkeypatch.setattr(sys, "argv", ["schedule_quality", *args.split()])
    main()
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.skipif(not (DATA / "elasticflow").is_dir(), reason="benchmark data not present")
def test_runs_split_by_scenario_merge_into_one_report_with_every_chart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = f"--jobs 4 --cluster 1x8 --series ES_2021 --horizon-slots 8 --data {DATA}"
    # One process per scenario, as the full bench is run: each leaves the others' targets out.
    deadlines = _run_bench(
        f"{tiny} --prices 200000 --scenarios deadlines --charts-dir {tmp_path / 'd'}",
        monkeypatch,
        capsys,
    )
    assert set(deadlines["by_series"]["ES_2021"]) == {
        "carbon-agnostic",
        "static",
        "carbon-greedy",
        "shift",
        "greenflow",
        "greenflow-price-200000",
    }
    targets = deadlines["targets"]["by_series"]["ES_2021"]
    assert targets["jct_vs_lagrangian_bound"]["ran"] is False
    assert targets["slack_workload_carbon"]["ran"] is False
    assert targets["carbon_at_same_deadline_ratio"]["upper_bound"] is not None
    plotted = json.loads((tmp_path / "d" / "schedule_quality_ES_2021.json").read_text())
    assert set(plotted) == {"deadline_ratio", "avg_jct"}
    rest = _run_bench(
        f"{tiny} --scenarios budget,slack --budget-shares 0.5 --frontier-prices 200000"
        f" --slack-prices 100000 --lagrangian-iterations 0 --charts-dir {tmp_path / 'r'}",
        monkeypatch,
        capsys,
    )
    assert rest["targets"]["by_series"]["ES_2021"]["carbon_at_same_deadline_ratio"]["ran"] is False
    paths = []
    for name, one in (("deadlines", deadlines), ("rest", rest)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(one))
    merged = _run_bench(
        f"--merge {paths[0]} {paths[1]} --charts-dir {tmp_path}", monkeypatch, capsys
    )
    png = tmp_path / "schedule_quality_ES_2021.png"
    assert merged["settings"]["charts"] == {"ES_2021": str(png)}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = merged["by_series"]["ES_2021"]
    assert runs == {**deadlines["by_series"]["ES_2021"], **rest["by_series"]["ES_2021"]}
    # Each target comes from the run that measured it.
    by_target = merged["targets"]["by_series"]["ES_2021"]
    assert by_target["carbon_at_same_deadline_ratio"] == targets["carbon_at_same_deadline_ratio"]
    for key in ("jct_vs_lagrangian_bound", "slack_workload_carbon"):
        assert by_target[key] == rest["targets"]["by_series"]["ES_2021"][key]
        assert merged["targets"][key]["ES_2021"]["figure"] == by_target[key]["figure"]
    plotted = json.loads(png.with_suffix(".json").read_text())
    every_job = {"greenflow", "carbon-agnostic", "static", "carbon-greedy", "shift"}
    assert set(plotted) == {"deadline_ratio", "avg_jct", "slack_avg_jct"}
    assert all(set(curves) == every_job for curves in plotted.values())
    # GreenFlow's sweep: price 0 and 200,000 s/kg; with and without the budget; the slack prices.
    keys = {panel: {p[2] for p in curves["greenflow"]} for panel, curves in plotted.items()}
    assert keys == {
        "deadline_ratio": {"greenflow", "greenflow-price-200000"},
        "avg_jct": {
            "greenflow-best-effort",
            "greenflow-best-effort-price-200000",
            "greenflow-capped",
        },
        "slack_avg_jct": {"slack-greenflow", "slack-greenflow-price-100000"},
    }
    # Each point is the run's own figures.
    for kg, met, key in plotted["deadline_ratio"]["greenflow"]:
        assert (kg, met) == (runs[key]["emissions_kg"], runs[key]["deadline_met_ratio"])
    frontier = by_target["frontier"]
    assert set(frontier["slack_avg_jct"]) == {
        "slack-carbon-agnostic",
        "slack-static",
        "slack-carbon-greedy",
        "slack-shift",
    }
    # The frontier is over every run: the budget panel's baselines are judged too.
    assert set(frontier["avg_jct"]) >= {"carbon-agnostic-capped", "static"}
    # A report merged with itself would count runs twice: refused.
    monkeypatch.setattr(sys, "argv", ["schedule_quality", "--merge", str(paths[0]), str(paths[0])])
    with pytest.raises(SystemExit) as refused:
        main()
    assert refused.value.code == 2
    assert "appear in two reports" in capsys.readouterr().err


def test_pareto_keeps_the_points_nothing_beats_at_no_more_carbon() -> None:
    points = [[30.0, 0.60, "a"], [34.0, 0.62, "b"], [35.0, 0.61, "c"], [29.0, 0.50, "d"]]
    assert [p[2] for p in pareto(points, higher_is_better=True)] == ["d", "a", "b"]
    jct = [[30.0, 7000.0, "a"], [34.0, 6000.0, "b"], [40.0, 6500.0, "c"]]
    assert [p[2] for p in pareto(jct, higher_is_better=False)] == ["a", "b"]
