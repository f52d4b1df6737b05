"""ElasticFlow's per-event overhead (`--elasticflow-overhead`), hand-computed on tiny traces.

ElasticFlow's simulator (pkusys/ElasticFlow, `ElasticFlow/scheduler/utils.py` `estimate_overhead`,
charged in `scheduler.py` `ef_sim_jobs_access_control`) takes a few seconds of progress from every
running job at every event: the base cost (2 s, 7 s on >= 256 GPUs) when the job's GPU set was used
since the last restart, else also 2 (log2 g + 1) s, plus 27 s (47 s) when the event is a restart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from energy_model.carbon.series import IntensitySeries, load_intensity_csv
from energy_model.profiles import ScalingProfile, load_scaling_profiles
from scheduler_service.allocation.policies import Policy
from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem, make_plan
from scheduler_service.simulate import engine
from scheduler_service.simulate.engine import (
    ElasticFlowOverhead,
    JobOutcome,
    SimulationConfig,
    SimulationError,
    elasticflow_overhead_s,
    simulate_trace,
)
from scheduler_service.simulate.trace import TraceJob, load_trace
from tests.simulate.test_simulate import T0, _app, write_profiles, write_series, write_trace


def _timed_policy(gpus_at: dict[str, list[tuple[float, int]]]) -> Policy:
    """Each job on the GPUs its schedule gives for the plan's start time (s from T0), else 1."""

    def policy(
        problem: AllocationProblem,
        *,
        previous: AllocationPlan | None,
        time_limit_s: float,
        seed: int,
    ) -> AllocationPlan:
        now_s = (problem.start_at - T0).total_seconds()
        gpus = {}
        for job in problem.jobs:
            count = 1
            for from_s, value in gpus_at.get(job.job_id, []):
                if now_s >= from_s - 1e-9:
                    count = value
            gpus[job.job_id] = (count,) * problem.num_slots
        return make_plan(problem, gpus, status="baseline", policy="scripted", solve_s=0.0)

    return policy


def test_overhead_formula_matches_elasticflow() -> None:
    """Base 2 s (7 s from 256 GPUs); unseen GPU sets add 2 (log2 g + 1) s and, at a restart, 27 (47) s."""
    assert elasticflow_overhead_s(1, 4, restart=False, cached=False) == pytest.approx(4.0)
    assert elasticflow_overhead_s(8, 255, restart=False, cached=False) == pytest.approx(10.0)
    assert elasticflow_overhead_s(8, 255, restart=True, cached=False) == pytest.approx(37.0)
    assert elasticflow_overhead_s(8, 256, restart=False, cached=False) == pytest.approx(15.0)
    assert elasticflow_overhead_s(64, 512, restart=True, cached=False) == pytest.approx(68.0)
    # A used GPU set costs the base only, even at a restart.
    assert elasticflow_overhead_s(64, 512, restart=True, cached=True) == pytest.approx(7.0)
    assert elasticflow_overhead_s(64, 4, restart=False, cached=True) == pytest.approx(2.0)


def test_gpu_set_cache_placement_and_restarts() -> None:
    """Largest first on contiguous ranks; every 3rd event restarts and empties the cache after it."""
    book = ElasticFlowOverhead(cluster_gpus=512, restart_every_events=3)
    assert book.event([("a", 8)]) == {"a": 15.0}  # event 0: ranks 0-7 are new
    assert book.event([("a", 8)]) == {"a": 7.0}  # event 1: same ranks
    assert book.event([("a", 8), ("b", 1)]) == {"a": 7.0, "b": 9.0}  # b on rank 8, new
    # Event 3 restarts: c (16 GPUs) goes first, so a moves to ranks 16-23, both new.
    assert book.event([("a", 8), ("c", 16)]) == {"a": 7.0 + 47 + 8, "c": 7.0 + 47 + 10}
    # The restart emptied the cache: the same sets are new again, without the restart cost.
    assert book.event([("a", 8), ("c", 16)]) == {"a": 15.0, "c": 17.0}
    assert book.event([("a", 8), ("c", 16)]) == {"a": 7.0, "c": 7.0}
    # Event 6 restarts, but used sets pay the base only; event 7 finds the cache empty.
    assert book.event([("a", 8), ("c", 16)]) == {"a": 7.0, "c": 7.0}
    assert book.event([("a", 8), ("c", 16)]) == {"a": 15.0, "c": 17.0}
    assert book.events == 8


def _toy_case(
    tmp_path: Path,
) -> tuple[list[TraceJob], IntensitySeries, dict[str, ScalingProfile]]:
    profiles = load_scaling_profiles(write_profiles(tmp_path))  # 10 it/s on 1 GPU, 18 on 2
    series = load_intensity_csv(write_series(tmp_path, [100.0] * 48))
    jobs = load_trace(write_trace(tmp_path, ["a,0,6000,toy,,32,1,600", "b,100,300,toy,,32,1,30"]))
    return jobs, series, profiles


def test_overhead_delays_finishes_by_the_hand_computed_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a: 1 GPU, then 2 GPUs from 60 s; b arrives at 100 s (in the slot after that change, so
    handled at 120 s) on 1 GPU."""
    jobs, series, profiles = _toy_case(tmp_path)
    monkeypatch.setattr(engine, "get_policy", lambda name: _timed_policy({"a": [(60.0, 2)]}))

    def run(overhead: bool) -> dict[str, JobOutcome]:
        config = SimulationConfig(
            "static",
            1,
            4,
            slot_s=60.0,
            horizon_slots=4,
            switch_s=30.0,
            switch_cost="flat",
            elasticflow_events=True,
            elasticflow_overhead=overhead,
        )
        return {o.job_id: o for o in simulate_trace(jobs, series, profiles, config).outcomes}

    before, after = run(False), run(True)
    # Off (unchanged): a's one count change at 60 s costs the 30 s switch; b runs 30 s from 120 s.
    assert before["a"].finish_s == pytest.approx(60 + 30 + (6000 - 600) / 18)
    assert before["b"].finish_s == pytest.approx(150.0)
    # On, 4 GPUs (< 256: base 2 s), events at 0 s (a arrives), 60 s (a's change), 120 s (b) and
    # 180 s (b done): 0 s: a new on rank 0 -> 2 + 2 = 4 s; 60 s: a (2 GPUs, ranks 0-1) new ->
    # 2 + 4 = 6 s; 120 s: a on ranks 0-1 again -> 2 s, b (rank 2) new -> 4 s; 180 s: a -> 2 s.
    # No switch_s on top.
    assert after["b"].finish_s == pytest.approx(120 + 4 + 30)
    lost_iterations = 4 * 10 + (6 + 2 + 2) * 18
    assert after["a"].finish_s == pytest.approx(60 + (6000 - 600 + lost_iterations) / 18)
    # The change is still counted, only not charged twice.
    assert after["a"].gpu_changes == before["a"].gpu_changes == 1


def test_overhead_carries_between_events_and_an_event_sets_it_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16 s overhead on 10 s slots runs into the next step unless an event replaces it."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "big.csv").write_text(
        "global_batch_size,1,2,4,8,16,32,64\n32,10,18,30,50,70,90,100\n"
    )
    profiles = load_scaling_profiles(folder)
    series = load_intensity_csv(write_series(tmp_path, [100.0] * 48))
    monkeypatch.setattr(engine, "get_policy", lambda name: _timed_policy({"a": [(0.0, 64)]}))
    config = SimulationConfig(
        "static",
        2,
        64,
        slot_s=10.0,
        horizon_slots=4,
        switch_s=0.0,
        elasticflow_events=True,
        elasticflow_overhead=True,
    )
    # a: 10,000 iterations = 100 s on 64 GPUs. Its first event costs 2 + 2 x 7 = 16 s (128 GPUs).
    alone = load_trace(write_trace(tmp_path, ["a,0,10000,big,,32,64,100"]))
    report = simulate_trace(alone, series, profiles, config)
    assert report.outcomes[0].finish_s == pytest.approx(16 + 100)
    # b arrives at 5 s: the event at 10 s drops the 6 s still owed and charges a 2 s (ranks 0-63
    # used), b 4 s; b (50 iterations, 5 s) ends at 19 s, so the event at 20 s charges a 2 s more.
    both = load_trace(write_trace(tmp_path, ["a,0,10000,big,,32,64,100", "b,5,50,big,,32,1,5"]))
    outcomes = {o.job_id: o for o in simulate_trace(both, series, profiles, config).outcomes}
    assert outcomes["b"].finish_s == pytest.approx(10 + 4 + 5)
    assert outcomes["a"].finish_s == pytest.approx(10 + 2 + 2 + 100)


def test_overhead_needs_elasticflow_events(tmp_path: Path) -> None:
    """The option alone is refused by the config and by the CLI (exit code 2, names the flag)."""
    with pytest.raises(SimulationError, match="elasticflow_events"):
        SimulationConfig("carbon-agnostic", 1, 4, elasticflow_overhead=True)
    assert SimulationConfig("carbon-agnostic", 1, 4).elasticflow_overhead is False
    out = tmp_path / "r.json"
    base = [
        "simulate",
        "--jobs",
        str(write_trace(tmp_path, ["a,0,600,toy,,32,1,60"])),
        "--carbon",
        str(write_series(tmp_path, [100.0] * 24)),
        "--profiles",
        str(write_profiles(tmp_path)),
        "--cluster",
        "1x4",
        "--policy",
        "carbon-agnostic",
        "--out",
        str(out),
        "--slot-s",
        "60",
        "--elasticflow-overhead",
    ]
    refused = CliRunner().invoke(_app(), base)
    assert refused.exit_code == 2
    assert "--elasticflow-overhead" in refused.output
    assert "needs --elasticflow-events" in refused.output
    assert not out.exists()
    accepted = CliRunner().invoke(_app(), [*base, "--elasticflow-events"])
    assert accepted.exit_code == 0, accepted.output
    payload = json.loads(out.read_text())
    assert payload["config"]["elasticflow_overhead"] is True
    # 600 iterations on 4 GPUs (30 it/s) = 20 s, after one event's 2 + 2 x 3 = 8 s.
    assert payload["jobs_detail"][0]["finish_s"] == pytest.approx(28.0)
