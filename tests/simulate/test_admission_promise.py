"""An admitted deadline is a promise: with exact models and no faults none is broken (issue 23).

The greenflow policy with exact models and forecasts, no carbon limit and no faults: every job
admitted with a deadline finishes by it (`admitted_missed == 0`), on a short slice of a public
ITP trace and on the seeded synthetic trace of long jobs with multi-day deadlines.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench.long_deadline_trace import generate
from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.allocation.admission import (
    HeldGpus,
    admit_on_spare,
    after_horizon_overcommitted,
)
from scheduler_service.allocation.problem import AllocationProblem, JobSpec, make_plan
from scheduler_service.simulate.cli import auto_horizon_slots
from scheduler_service.simulate.engine import SimulationConfig, SimulationReport, simulate_trace
from scheduler_service.simulate.trace import TraceJob, load_trace


def _replay(
    shared_data: Path,
    jobs: list[TraceJob],
    profiles: str,
    cluster: tuple[int, int],
    slot_s: float,
    horizon_slots: int,
    events: bool,
) -> SimulationReport:
    """A greenflow replay with exact models, no budget, no faults."""
    series = load_intensity_csv(shared_data / "carbon" / "electricitymaps" / "ES_2021_hourly.csv")
    config = SimulationConfig(
        policy="greenflow",
        num_nodes=cluster[0],
        gpus_per_node=cluster[1],
        slot_s=slot_s,
        horizon_slots=horizon_slots,
        elasticflow_events=events,
        time_limit_s=0.1,
    )
    return simulate_trace(
        jobs, series, load_scaling_profiles(shared_data / "elasticflow" / profiles), config
    )


def _broken(report: SimulationReport) -> list[tuple[str, float | None]]:
    broken = [
        (o.job_id, o.lateness_s) for o in report.outcomes if o.guaranteed and not o.deadline_met
    ]
    assert report.admitted_missed == len(broken)
    return broken


@pytest.mark.parametrize(("slot_s", "events"), [(900.0, False), (60.0, True)])
def test_itp_slice_keeps_every_admitted_deadline(
    shared_data: Path, slot_s: float, events: bool
) -> None:
    jobs = load_trace(shared_data / "elasticflow" / "itp" / "cluster01.csv", limit=12)
    report = _replay(
        shared_data,
        jobs,
        "throughputs_A100",
        (2, 8),
        slot_s,
        auto_horizon_slots(jobs, slot_s),
        events,
    )
    assert _broken(report) == []
    assert report.admitted > 0
    assert sum(1 for o in report.outcomes if o.deadline_met) == report.admitted


def test_switch_stalls_do_not_break_a_promise(shared_data: Path) -> None:
    # 60 s slots, 30 s hot switches: before plans counted the stalls (e2df05e), greenflow broke
    # one promise here: a finish its planned switches pushed past the deadline.
    jobs = load_trace(shared_data / "elasticflow" / "itp" / "cluster01.csv", limit=16)[8:]
    report = _replay(
        shared_data, jobs, "throughputs_A100", (2, 8), 60.0, auto_horizon_slots(jobs, 60.0), True
    )
    assert report.admitted > 0
    assert _broken(report) == []


def test_a_high_carbon_price_does_not_trade_a_promise_for_two_margins(shared_data: Path) -> None:
    # 200,000 s/kg on CAISO carbon, 900 s slots, the quality bench's 96-slot horizon and 0.5 s:
    # before a broken promise cost more than a finish inside the 60 s margin, a tick traded the
    # plan in force (3dba6da8 and ffa361be 4 s and 1 s inside their margins) for one dropping
    # bf8e8bfa, which then finished 640.7 s late here (main at 357088c; 1,899 s on [:40]).
    # The flat 30 s switch of that run: with the measured switch model (the default since
    # e9cc7d6) this slice keeps the promise without the tier too, and would test nothing.
    jobs = load_trace(shared_data / "elasticflow" / "itp" / "cluster01.csv", limit=20)
    series = load_intensity_csv(
        shared_data / "carbon" / "electricitymaps" / "US-CAL-CISO_2021_hourly.csv"
    )
    config = SimulationConfig(
        policy="greenflow",
        num_nodes=2,
        gpus_per_node=8,
        horizon_slots=96,
        carbon_price_s_per_kg=200_000.0,
        time_limit_s=0.5,
        switch_cost="flat",
    )
    profiles = load_scaling_profiles(shared_data / "elasticflow" / "throughputs_A100")
    report = simulate_trace(jobs, series, profiles, config)
    assert report.admitted > 0
    assert _broken(report) == []


def test_synthetic_multi_day_deadlines_are_kept(shared_data: Path) -> None:
    profiles = load_scaling_profiles(shared_data / "elasticflow" / "throughputs_T4")
    jobs = generate(profiles, 8, seed=0, span_h=12.0, long_share=0.5, max_gpus=4)
    # Deadlines a day or more away, far past a 4 h horizon. Before admission checked the work
    # left after the horizon jointly (each job was assumed to run alone at full speed there),
    # syn0004 was admitted and finished 17,274 s late here (main at 74e6e27).
    assert max((j.deadline_s or 0.0) - j.submission_s for j in jobs) > 86_400.0
    report = _replay(shared_data, jobs, "throughputs_T4", (1, 4), 1800.0, 8, False)
    assert report.admitted > 0
    assert _broken(report) == []


def test_after_horizon_check_counts_the_jobs_together() -> None:
    # 4 GPUs, a 1 h horizon of 4 slots; each job needs 4 GPUs x 10 h after it (30 samples/s on
    # 4 GPUs, 10 on 1), due 11 h from now: alone each fits, together they do not.
    def job(job_id: str) -> JobSpec:
        return JobSpec(
            job_id=job_id,
            allowed_gpus=(1, 4),
            throughput_samples_per_s=(10.0, 30.0),
            power_w=(100.0, 400.0),
            remaining_samples=30.0 * 36_000,
            deadline_s=11 * 3600.0,
        )

    problem = AllocationProblem(
        start_at=datetime(2021, 1, 1, tzinfo=UTC),
        slot_s=900.0,
        capacity_gpus=(4,) * 4,
        intensity_g_per_kwh=(100.0,) * 4,
        jobs=(job("a"),),
    )
    idle: dict[str, tuple[int, ...]] = {"a": (0, 0, 0, 0)}
    one = make_plan(problem, idle, status="test", policy="test", solve_s=0.0)
    assert one.deadline_met["a"] and after_horizon_overcommitted(problem, one.gpus) == []
    both = replace(problem, jobs=(job("a"), job("b")))
    plan = make_plan(both, {**idle, "b": (0, 0, 0, 0)}, status="test", policy="test", solve_s=0.0)
    # Plans see them together too (`evaluate_gpus`, since h3's fix of issue 23's cluster04[:20]
    # broken promise): before, each was seen alone at full speed and both counted as met.
    assert plan.deadline_met == {"a": True, "b": False}
    assert after_horizon_overcommitted(both, plan.gpus) == ["b"]


def test_incremental_admission_checks_after_the_horizon_too() -> None:
    # The same two jobs: "a" is in the plan in force (held off for the horizon), "b" arrives.
    # On the GPUs the plan leaves, b alone meets its deadline, but after the horizon the two
    # need 4 GPUs for 19 h before 11 h: the incremental check must say it cannot promise b.
    def job(job_id: str, deadline_h: float) -> JobSpec:
        return JobSpec(
            job_id=job_id,
            allowed_gpus=(1, 4),
            throughput_samples_per_s=(10.0, 30.0),
            power_w=(100.0, 400.0),
            remaining_samples=30.0 * 36_000,
            deadline_s=deadline_h * 3600.0,
        )

    start = datetime(2021, 1, 1, tzinfo=UTC)
    problem = AllocationProblem(
        start_at=start,
        slot_s=900.0,
        capacity_gpus=(4,) * 4,
        intensity_g_per_kwh=(100.0,) * 4,
        jobs=(job("a", 11.0),),
    )
    in_force = HeldGpus(start, 900.0, {"a": (0, 0, 0, 0)})
    assert admit_on_spare(problem, job("b", 11.0), in_force) is None
    # Due a day later, b fits after a: admitted on the spare GPUs, promised all four slots.
    admitted = admit_on_spare(problem, job("b", 35.0), in_force)
    assert admitted is not None
    decision, held = admitted
    assert decision.admitted and decision.guaranteed
    assert held.gpus["b"] == (4, 4, 4, 4)
