"""Job model parity with ElasticFlow's simulator (see docs/allocation.md, "Comparability").

ElasticFlow (pkusys/ElasticFlow, ElasticFlow/scheduler) lets an ITP job use the GPU counts of
the throughput table's columns (powers of two) up to a per-model cap (`models.get_max_gpu`,
A100 branch), and runs `num_iteration` iterations at the table's iterations/s for the job's exact
global batch size. Our simulator drops counts that are no faster than a smaller one and works in
samples; these tests pin that both give the same choices and the same run times on the ITP models.
"""

from __future__ import annotations

import csv
import math
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.simulate.engine import SimulationConfig, simulate_trace
from scheduler_service.simulate.trace import (
    TraceJob,
    deadlines_beyond_horizon,
    job_tables,
    load_trace,
)
from tests.simulate.test_simulate import _app, write_profiles, write_series, write_trace

# ElasticFlow's per-(model, global batch) GPU cap on A100 for the batch sizes of the ITP traces
# (models.get_max_gpu): the facts our dominated-count rule has to reproduce.
ELASTICFLOW_A100_MAX_GPUS = {
    ("bert", 64): 8,
    ("bert", 128): 16,
    ("deepspeech2", 32): 32,
    ("deepspeech2", 64): 64,
    ("gpt2", 128): 16,
    ("gpt2", 256): 32,
    ("inception3", 64): 16,
    ("inception3", 128): 32,
    ("resnet50", 64): 32,
    ("resnet50", 128): 64,
    ("resnet50", 256): 64,
    ("vgg16", 64): 32,
    ("vgg16", 128): 64,
    ("vgg16", 256): 64,
}


def _job(model: str, batch: int, iterations: int = 1000) -> TraceJob:
    return TraceJob("j", 0.0, iterations, model, None, batch, 1, 1.0)


def test_allowed_counts_match_elasticflow_levels(shared_data: Path) -> None:
    """On a 64x8 cluster every ITP (model, batch) gets 1, 2, 4, ... up to ElasticFlow's cap."""
    profiles = load_scaling_profiles(shared_data / "elasticflow" / "throughputs_A100")
    for (model, batch), cap in ELASTICFLOW_A100_MAX_GPUS.items():
        tables = job_tables(_job(model, batch), profiles, max_gpus=512)
        levels = tuple(2**k for k in range(int(math.log2(cap)) + 1))
        assert tables.allowed_gpus == levels, (model, batch)


def test_itp_batches_are_measured_and_run_times_match(shared_data: Path) -> None:
    """Every ITP batch size is in the tables, so time = num_iteration / iterations_per_s exactly."""
    root = shared_data / "elasticflow"
    profiles = load_scaling_profiles(root / "throughputs_A100")
    with (root / "itp" / "cluster01.csv").open(newline="") as handle:
        pairs = {(r["model_name"], int(r["batch_size"])) for r in csv.DictReader(handle)}
    assert pairs <= set(ELASTICFLOW_A100_MAX_GPUS)
    for model, batch in sorted(pairs):
        profile = profiles[model]
        # No nearest-batch fallback is involved: ElasticFlow looks the exact batch up.
        assert profile.nearest_batch_size(batch) == batch
        job = _job(model, batch, iterations=12_345)
        tables = job_tables(job, profiles, max_gpus=512)
        for gpus, samples_per_s in zip(
            tables.allowed_gpus, tables.throughput_samples_per_s, strict=True
        ):
            ours_s = job.total_samples / samples_per_s
            theirs_s = job.num_iteration / profile.iterations_per_s[batch][gpus]
            assert ours_s == pytest.approx(theirs_s, rel=1e-12)


def test_deadlines_past_the_horizon_are_counted_and_the_cli_warns(tmp_path: Path) -> None:
    """A deadline window longer than slot x horizon is flagged: admission is optimistic there."""
    trace = write_trace(
        tmp_path,
        ["a,0,3600,toy,7200,32,1,360", "b,100,3600,toy,4000,32,1,360", "c,200,3600,toy,,32,1,360"],
    )
    jobs = load_trace(trace)
    assert deadlines_beyond_horizon(jobs, 3600.0) == 2  # a: 7,200 s window; b: 3,900 s; c: none
    assert deadlines_beyond_horizon(jobs, 3900.0) == 1
    assert deadlines_beyond_horizon(jobs, 7200.0) == 0
    base = [
        "simulate",
        "--jobs",
        str(trace),
        "--carbon",
        str(write_series(tmp_path, [100.0] * 24)),
        "--profiles",
        str(write_profiles(tmp_path)),
        "--cluster",
        "1x4",
        "--policy",
        "carbon-agnostic",
        "--out",
        str(tmp_path / "r.json"),
        "--slot-s",
        "900",
    ]
    short = CliRunner().invoke(_app(), [*base, "--horizon-slots", "4"])
    assert short.exit_code == 0, short.output
    assert "warning: 2 of 3 jobs have a deadline further off than the 1 h" in short.output
    covered = CliRunner().invoke(_app(), [*base, "--horizon-slots", "8"])
    assert covered.exit_code == 0, covered.output
    assert "warning" not in covered.output


def test_elasticflow_events_admit_an_arrival_batch_together_and_after_a_slot(
    tmp_path: Path,
) -> None:
    """With ElasticFlow's events one infeasible arrival declines its batch; arrivals wait a slot."""
    profiles = load_scaling_profiles(write_profiles(tmp_path))  # toy: 10 it/s on 1 GPU, 30 on 4
    series = load_intensity_csv(write_series(tmp_path, [100.0] * 24))
    jobs = load_trace(
        write_trace(
            tmp_path,
            [
                "ok,0,3600,toy,2000,32,1,360",  # 360 s on 1 GPU: feasible alone
                "hopeless,0,36000,toy,100,32,1,3600",  # >= 1,200 s, deadline in 100 s
                "later,100,3000,toy,1400,32,1,300",  # arrives 100 s in, 300 s on 1 GPU
                "busy,0,360000,toy,,32,1,36000",  # no deadline: keeps the cluster busy
            ],
        )
    )
    base = SimulationConfig("carbon-agnostic", 1, 4, slot_s=900.0, horizon_slots=8, switch_s=0.0)
    ours = {o.job_id: o for o in simulate_trace(jobs, series, profiles, base).outcomes}
    assert ours["ok"].deadline_met and not ours["hopeless"].admitted
    # Admitted on arrival: done by its deadline, well before the 900 s slot ends.
    assert ours["later"].deadline_met and ours["later"].finish_s is not None
    assert ours["later"].finish_s < 900.0
    ef = replace(base, elasticflow_events=True)
    theirs = {o.job_id: o for o in simulate_trace(jobs, series, profiles, ef).outcomes}
    assert not theirs["ok"].admitted and not theirs["hopeless"].admitted
    assert "arrival batch" in theirs["ok"].reject_reason
    # Handled at the slot's end (900 s), then 300 s on 1 GPU: it still makes 1,400 s.
    assert theirs["later"].deadline_met and theirs["later"].finish_s is not None
    assert theirs["later"].finish_s >= 900.0


def test_elasticflow_events_an_arrival_after_a_quiet_slot_is_an_event_of_its_own(
    tmp_path: Path,
) -> None:
    """ElasticFlow merges only the slot after an event: after a step with no event (no arrival,
    completion or count change) the next arrival is handled at its own time, not a slot later."""
    profiles = load_scaling_profiles(write_profiles(tmp_path))  # toy: 10 it/s on 1 GPU, 30 on 4
    series = load_intensity_csv(write_series(tmp_path, [100.0] * 24))
    jobs = load_trace(
        write_trace(
            tmp_path,
            [
                "busy,0,360000,toy,,32,4,36000",  # no deadline: 4 GPUs, unchanged, for 12,000 s
                "lone,1000,3000,toy,1500,32,1,300",  # 100 s on 4 GPUs, due 500 s after arrival
            ],
        )
    )
    ef = SimulationConfig(
        "carbon-agnostic",
        1,
        4,
        slot_s=900.0,
        horizon_slots=8,
        switch_s=0.0,
        elasticflow_events=True,
    )
    outcomes = {o.job_id: o for o in simulate_trace(jobs, series, profiles, ef).outcomes}
    # The step from 900 s had no event, so the arrival at 1,000 s starts one: on the 900 s grid
    # it would wait until 1,800 s, past its deadline, and be declined.
    lone = outcomes["lone"]
    assert lone.admitted and lone.deadline_met
    assert lone.finish_s is not None and 1000.0 < lone.finish_s <= 1500.0
