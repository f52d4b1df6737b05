"""ElasticFlow's other trace formats (`elasticVpollux_e.csv`, `philly_103959.csv`) are read by
the same loader; the fixtures are our own rows written in those formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.simulate.engine import SimulationConfig, simulate_trace
from scheduler_service.simulate.trace import TraceError, load_trace

FIXTURES = Path(__file__).parent / "fixtures"
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def test_pollux_format_reads_submit_time_iteration_and_ddl() -> None:
    jobs = load_trace(FIXTURES / "pollux_format.csv")
    assert [j.job_id for j in jobs] == ["0", "1", "2", "3", "4"]
    first = jobs[0]
    assert (first.submission_s, first.num_iteration, first.deadline_s) == (5000100, 1200, 5004000)
    assert (first.model_name, first.batch_size, first.num_gpu) == ("cifar10", 4096, 1)


def test_philly_format_takes_iteration_not_real_iteration_like_elasticflow() -> None:
    jobs = {j.job_id: j for j in load_trace(FIXTURES / "philly_format.csv")}
    # ElasticFlow's jobs.py prefers `iteration` when the trace has it.
    assert jobs["0"].num_iteration == 50000 and jobs["0"].duration_s == 7900
    # sys.maxsize as the deadline is ElasticFlow's best-effort job: no deadline.
    assert jobs["3"].deadline_s is None


def test_a_best_effort_column_drops_the_deadline(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "job_id,submit_time,iteration,model_name,ddl,batch_size,num_gpu,duration,best_effort\n"
        "a,0,100,bert,900,384,1,60,1\nb,0,100,bert,900,384,1,60,0\n"
    )
    jobs = {j.job_id: j for j in load_trace(path)}
    assert jobs["a"].deadline_s is None and jobs["b"].deadline_s == 900


def test_missing_fields_name_every_accepted_column(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("job_id,iteration,model_name,batch_size,num_gpu,duration\na,1,bert,1,1,1\n")
    with pytest.raises(TraceError, match="submission_time or submit_time, deadline or ddl"):
        load_trace(path)


@pytest.mark.skipif(not (DATA / "elasticflow").is_dir(), reason="shared data not present")
def test_pollux_format_replays_with_the_t4_profiles() -> None:
    jobs = load_trace(FIXTURES / "pollux_format.csv")
    profiles = load_scaling_profiles(DATA / "elasticflow" / "throughputs_T4")
    series = load_intensity_csv(DATA / "carbon" / "electricitymaps" / "ES_2021_hourly.csv")
    config = SimulationConfig(
        policy="carbon-agnostic", num_nodes=2, gpus_per_node=4, slot_s=300.0, horizon_slots=48
    )
    report = simulate_trace(jobs, series, profiles, config)
    assert report.jobs == 5 and report.deadline_jobs == 5
    assert report.finished == report.admitted > 0
