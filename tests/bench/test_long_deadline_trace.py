"""The synthetic long-deadline trace: seeded, readable by the simulator, multi-day deadlines."""

from __future__ import annotations

from pathlib import Path

from bench.long_deadline_trace import generate, main, write_trace_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.simulate.trace import job_tables, load_trace


def test_trace_is_seeded_and_round_trips(shared_data: Path, tmp_path: Path) -> None:
    profiles = load_scaling_profiles(shared_data / "elasticflow" / "throughputs_T4")
    first = generate(profiles, 40, seed=3)
    assert first == generate(profiles, 40, seed=3)
    assert first != generate(profiles, 40, seed=4)
    path = tmp_path / "trace.csv"
    write_trace_csv(first, path)
    again = load_trace(path)
    assert [(j.job_id, j.num_iteration, j.model_name, j.batch_size, j.num_gpu) for j in again] == [
        (j.job_id, j.num_iteration, j.model_name, j.batch_size, j.num_gpu) for j in first
    ]
    assert all(j.deadline_s is not None for j in again)
    windows_s = [(j.deadline_s or 0.0) - j.submission_s for j in again]
    # Long jobs' deadlines lie days away; every deadline leaves room for the run itself.
    assert max(windows_s) > 86_400.0
    assert all(w > j.duration_s for w, j in zip(windows_s, again, strict=True))
    for job in again:
        assert job.model_name in profiles
        # The requested count is one the simulator keeps (not dominated, within 16 GPUs).
        assert job.num_gpu in job_tables(job, profiles, 64).allowed_gpus and job.num_gpu <= 16


def test_cli_writes_the_csv(shared_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.csv"
    assert main(["--data", str(shared_data), "--jobs", "5", "--out", str(out)]) == 0
    assert len(load_trace(out)) == 5
    assert main(["--data", str(tmp_path / "none"), "--jobs", "5", "--out", str(out)]) == 2
