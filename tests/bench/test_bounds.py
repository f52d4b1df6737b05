"""The average-JCT lower bound: exact on one job alone, never above what any policy measures."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bench.bounds.completion_mip import avg_jct_lower_bound_mip
from bench.bounds.fluid import (
    SEGMENTS,
    avg_jct_lower_bound,
    job_limits,
)
from bench.bounds.lagrangian import avg_jct_lagrangian_bound
from energy_model.carbon.series import IntensitySeries, load_intensity_csv
from energy_model.profiles import ScalingProfile, load_scaling_profiles
from scheduler_service.allocation.policies import POLICIES
from scheduler_service.allocation.snapshot import BudgetWindow
from scheduler_service.simulate.engine import CarbonClock, SimulationConfig, simulate_trace
from scheduler_service.simulate.trace import TraceJob, job_tables, load_trace

T0 = datetime(2021, 1, 1, tzinfo=UTC)
# One model: 10 it/s on 1 GPU, 18 on 2, 30 on 4 at global batch 32 (960 samples/s at 4 GPUs).
TOY = {"toy": ScalingProfile("toy", {32: {1: 10.0, 2: 18.0, 4: 30.0}})}


def hourly(values: list[float]) -> IntensitySeries:
    return IntensitySeries(
        tuple(T0 + timedelta(hours=i) for i in range(len(values))), tuple(values), source="test"
    )


def toy_job(
    job_id: str, release_s: float, iterations: int, deadline_s: float | None = None
) -> TraceJob:
    return TraceJob(job_id, release_s, iterations, "toy", deadline_s, 32, 4, 3600.0)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_one_job_alone_bound_is_its_run_time_at_full_speed(policy: str) -> None:
    # 108,000 iterations at 30 it/s: 3,600 s on 4 GPUs, released on an hour mark, so it ends on
    # a slot edge: every slot it uses is used fully, where the LP's terms are exact, and the bound
    # is its run time (no schedule can finish it sooner; running at 4 GPUs at once achieves it).
    series = hourly([300.0, 80.0, 120.0])
    job = toy_job("a", 7200.0, 108_000)
    config = SimulationConfig(policy=policy, num_nodes=1, gpus_per_node=4)
    bound = avg_jct_lower_bound([job], series, TOY, config)
    assert bound.avg_jct_s == pytest.approx(3600.0, rel=1e-9)
    assert bound.tail_work == 0.0
    report = simulate_trace([job], series, TOY, config)
    assert bound.avg_jct_s <= report.avg_jct_all_s + 1e-6  # type: ignore[operator]


def test_one_job_released_mid_slot_is_within_the_tangent_error() -> None:
    # 5,400 s at full speed from 1,000 s past an hour mark: the last slot is used 2,800 s of
    # 3,600, where p y^2 / 2 is taken from its tangents (at most p u^2 / (8 (M-1)^2) below).
    series = hourly([300.0, 80.0, 120.0])
    job = toy_job("a", 8200.0, 162_000)
    config = SimulationConfig(policy="carbon-agnostic", num_nodes=1, gpus_per_node=4)
    bound = avg_jct_lower_bound([job], series, TOY, config)
    run_s = 5400.0
    u = 3600.0 / run_s
    assert run_s - run_s * u**2 / (8 * (SEGMENTS - 1) ** 2) <= bound.avg_jct_s <= run_s + 1e-6
    report = simulate_trace([job], series, TOY, config)
    assert report.avg_jct_all_s == pytest.approx(run_s)


def test_a_daily_budget_bound_matches_the_hand_computed_earliest_finish() -> None:
    # 48 h of work on the one GPU at a flat intensity; each day's budget pays for 12 h of it.
    # Inside each day's window (the day less a slot-wide margin at each inner edge, since the
    # replay charges an interval across an edge to both days by time) the job alone does at
    # most 12 h of work; in the 1,800 s around each edge only its speed limits it. So by
    # 72.25 h it has done at most 3 x (12 h + 0.5 h) = 37.5 h and needs 10.5 h more: no
    # schedule within the budget finishes before 82.75 h (the fluid LP alone gave 66 h).
    series = hourly([300.0] * 24)
    job = toy_job("a", 0.0, 1_728_000)
    free_config = SimulationConfig(policy="static", num_nodes=1, gpus_per_node=1)
    free = simulate_trace([job], series, TOY, free_config)
    capped_config = replace(free_config, budget_kg=free.emissions_kg / 4, budget_period="day")
    free_bound = avg_jct_lower_bound([job], series, TOY, free_config)
    capped_bound = avg_jct_lower_bound([job], series, TOY, capped_config)
    assert free_bound.avg_jct_s == pytest.approx(48 * 3600.0, rel=1e-9)
    assert capped_bound.avg_jct_s == pytest.approx(82.75 * 3600.0, rel=1e-6)
    assert capped_bound.tail_work == 0.0
    capped = simulate_trace([job], series, TOY, capped_config)
    assert capped.budget_violations == 0 and capped.unfinished == 0
    assert capped_bound.avg_jct_s <= capped.avg_jct_all_s  # type: ignore[operator]


@settings(max_examples=150, deadline=None)
@given(
    intensities=st.lists(st.floats(20.0, 600.0), min_size=12, max_size=12),
    counts=st.lists(st.sampled_from([0, 1, 2, 4]), min_size=12, max_size=12),
    release_s=st.floats(0.0, 5000.0),
    slack=st.lists(st.floats(1.0, 1.5), min_size=4, max_size=4),
    iterations=st.integers(20_000, 300_000),
)
def test_job_floors_hold_for_any_schedule_within_the_windows(
    intensities: list[float],
    counts: list[int],
    release_s: float,
    slack: list[float],
    iterations: int,
) -> None:
    # One job run at a count per hour from its release; each window's budget is what this
    # schedule emits inside it times a slack >= 1, so the schedule is within every budget.
    series = hourly(intensities)
    job = toy_job("a", release_s, iterations)
    table = job_tables(job, TOY, 4)
    clock = CarbonClock(series, 1.0)
    rate = {c: r for c, r in zip(table.allowed_gpus, table.throughput_samples_per_s, strict=True)}
    power = dict(zip(table.allowed_gpus, table.power_w, strict=True))
    # Runs (from_s, to_s, count) until the work is done.
    runs: list[tuple[float, float, int]] = []
    done = 0.0
    for hour, count in enumerate(counts):
        start = max(hour * 3600.0, release_s)
        end = (hour + 1) * 3600.0
        if count == 0 or end <= start or done >= 1.0:
            continue
        speed = rate[count] / job.total_samples
        end = min(end, start + (1.0 - done) / speed)
        runs.append((start, end, count))
        done += (end - start) * speed
    assume(done >= 1.0 - 1e-12)
    finish_s = runs[-1][1]
    # int_r^C f dt over the piecewise-linear progress.
    done_integral = 0.0
    progress = 0.0
    cursor = release_s
    for start, end, count in runs:
        done_integral += progress * (start - cursor)
        gained = (end - start) * rate[count] / job.total_samples
        done_integral += (progress + gained / 2) * (end - start)
        progress += gained
        cursor = end
    # Budget windows with free gaps between them, as the bound's day windows leave at day edges.
    spans = [(0.0, 10_000.0), (11_000.0, 25_000.0), (26_500.0, 33_000.0), (36_000.0, 43_200.0)]
    windows = []
    for (w_from, w_to), k in zip(spans, slack, strict=True):
        kg = sum(
            power[c] * clock.kg_per_w(max(a, w_from), min(b, w_to))
            for a, b, c in runs
            if min(b, w_to) > max(a, w_from)
        )
        windows.append(BudgetWindow(w_from, w_to, kg * k))
    limits = job_limits(job, table, clock, windows, 43_200.0, fine_s=1.0)
    assert finish_s - release_s >= limits.earliest_jct_s - 1e-6
    assert done_integral >= limits.done_integral_s - 1e-6
    assert limits.done_integral_s >= 0.5 * job.total_samples / max(rate.values()) - 1e-6


def contended_trace() -> tuple[IntensitySeries, list[TraceJob]]:
    """Five jobs on 4 GPUs, arrivals inside slots, two with deadlines, a varying intensity."""
    series = hourly([400.0, 50.0, 200.0, 120.0] * 6)
    jobs = [
        toy_job("a", 0.0, 108_000, 9000.0),
        toy_job("b", 500.0, 54_000),
        toy_job("c", 1300.0, 200_000, 20_000.0),
        toy_job("d", 4000.0, 30_000),
        toy_job("e", 4100.0, 150_000),
    ]
    return series, jobs


def check_every_policy(
    jobs: list[TraceJob],
    series: IntensitySeries,
    profiles: dict[str, ScalingProfile],
    cluster: tuple[int, int],
    horizon_slots: int,
) -> None:
    """Bound <= measured avg JCT for every policy, uncapped (admitted jobs) and capped."""
    base = SimulationConfig(
        "carbon-agnostic",
        *cluster,
        horizon_slots=horizon_slots,
        time_limit_s=0.5,
    )
    bounds: dict[tuple[float | None, frozenset[str]], float] = {}

    def check(config: SimulationConfig) -> float:
        report = simulate_trace(jobs, series, profiles, config)
        assert report.unfinished == 0 and report.budget_violations == 0, config.policy
        admitted = frozenset(o.job_id for o in report.outcomes if o.admitted)
        key = (config.budget_kg, admitted)
        if key not in bounds:
            bound = avg_jct_lower_bound(jobs, series, profiles, config, only=admitted)
            assert bound.tail_work == 0.0
            bounds[key] = bound.avg_jct_s
        measured = report.avg_jct_all_s
        assert measured is not None
        assert bounds[key] <= measured * (1 + 1e-9), (config.policy, config.budget_kg)
        return report.emissions_kg

    for policy in POLICIES:
        check(replace(base, policy=policy))
    # Model and forecast error change what a policy sees, not what runs: the bound still holds
    # (uncapped only: under a budget such a policy may overspend, and is then outside the bound).
    check(replace(base, policy="greenflow", model_error=0.3, forecast_error=0.2, seed=3))
    reference_kg = check(replace(base, best_effort=True))
    capped = replace(base, best_effort=True, budget_kg=reference_kg * 0.5, budget_period="day")
    for policy in POLICIES:
        check(replace(capped, policy=policy))
    # The budget binds: under it the bound is higher than without it.
    all_ids = frozenset(j.job_id for j in jobs)
    assert bounds[(capped.budget_kg, all_ids)] > bounds[(None, all_ids)]


def test_bound_is_below_every_policy_on_a_small_contended_trace() -> None:
    # Five jobs on 4 GPUs, arrivals inside slots, two with deadlines, a varying intensity.
    series, jobs = contended_trace()
    check_every_policy(jobs, series, TOY, (1, 4), horizon_slots=16)


def test_bound_is_below_every_policy_on_a_public_trace_slice(shared_data: Path) -> None:
    ef = shared_data / "elasticflow"
    jobs = load_trace(ef / "itp" / "cluster01.csv", limit=12)
    series = load_intensity_csv(shared_data / "carbon" / "electricitymaps" / "ES_2021_hourly.csv")
    profiles = load_scaling_profiles(ef / "throughputs_A100")
    check_every_policy(jobs, series, profiles, (1, 8), horizon_slots=24)


def test_a_horizon_too_short_still_gives_a_lower_bound() -> None:
    # Work past the LP's horizon is unconstrained but costs its distance from the release, so
    # a horizon that cuts the schedule off still bounds it (more loosely).
    series = hourly([400.0, 50.0, 200.0, 120.0] * 6)
    jobs = [toy_job("a", 0.0, 108_000), toy_job("b", 500.0, 216_000), toy_job("c", 900.0, 54_000)]
    config = SimulationConfig("greenflow", 1, 4, horizon_slots=8, time_limit_s=0.5)
    full = avg_jct_lower_bound(jobs, series, TOY, config)
    short = avg_jct_lower_bound(jobs, series, TOY, config, horizon_s=3600.0, max_rounds=1)
    assert full.tail_work == 0.0 and short.tail_work > 0.5
    assert short.avg_jct_s <= full.avg_jct_s
    # Left to grow (doubling while work is left past it), the same start ends with no tail.
    grown = avg_jct_lower_bound(jobs, series, TOY, config, horizon_s=3600.0)
    assert grown.tail_work == 0.0 and grown.horizon_s >= 4 * 3600.0
    assert short.avg_jct_s <= grown.avg_jct_s
    report = simulate_trace(jobs, series, TOY, config)
    assert full.avg_jct_s <= report.avg_jct_all_s  # type: ignore[operator]


def test_completion_mip_bound_is_below_every_capped_policy_and_above_the_lp() -> None:
    # The small contended trace under a daily budget: the MIP adds completion indicators (1-h
    # segments) to the LP, so its bound is at least the LP's and still below every policy.
    series, jobs = contended_trace()
    base = SimulationConfig("carbon-agnostic", 1, 4, horizon_slots=16, time_limit_s=0.5)
    reference = simulate_trace(jobs, series, TOY, replace(base, best_effort=True))
    capped = replace(
        base, best_effort=True, budget_kg=reference.emissions_kg * 0.5, budget_period="day"
    )
    lp = avg_jct_lower_bound(jobs, series, TOY, capped)
    mip = avg_jct_lower_bound_mip(
        jobs, series, TOY, capped, segment_s=3600.0, horizon_s=lp.horizon_s, time_limit_s=60.0
    )
    assert mip.closed and mip.binaries > 0
    assert mip.avg_jct_s >= lp.avg_jct_s - 1e-6 * lp.avg_jct_s
    for policy in POLICIES:
        report = simulate_trace(jobs, series, TOY, replace(capped, policy=policy))
        assert report.unfinished == 0 and report.budget_violations == 0, policy
        assert report.avg_jct_all_s is not None
        assert mip.avg_jct_s <= report.avg_jct_all_s * (1 + 1e-9), (policy, mip)


def test_lagrangian_bound_is_exact_on_one_job_and_below_every_policy() -> None:
    # One job alone (no budget): its run time at full speed (3,600 s), as for the LP.
    series = hourly([300.0, 80.0, 120.0])
    config = SimulationConfig(policy="carbon-agnostic", num_nodes=1, gpus_per_node=4)
    one = [toy_job("a", 7200.0, 108_000)]
    horizon = avg_jct_lower_bound(one, series, TOY, config).horizon_s
    alone = avg_jct_lagrangian_bound(one, series, TOY, config, horizon_s=horizon, iterations=3)
    assert alone.avg_jct_s == pytest.approx(3600.0, abs=1.0)
    assert alone.avg_jct_s <= 3600.0 + 1e-6
    # The small contended trace, best effort uncapped and under a daily budget: above the LP
    # (exact completion times instead of the fluid terms) and below every policy.
    series, jobs = contended_trace()
    base = SimulationConfig(
        "carbon-agnostic", 1, 4, horizon_slots=16, time_limit_s=0.5, best_effort=True
    )
    reference = simulate_trace(jobs, series, TOY, base)
    capped = replace(base, budget_kg=reference.emissions_kg * 0.5, budget_period="day")
    for config in (base, capped):
        lp = avg_jct_lower_bound(jobs, series, TOY, config)
        lag = avg_jct_lagrangian_bound(
            jobs, series, TOY, config, horizon_s=lp.horizon_s, iterations=20
        )
        assert lag.avg_jct_s >= lp.avg_jct_s
        for policy in POLICIES:
            report = simulate_trace(jobs, series, TOY, replace(config, policy=policy))
            assert report.unfinished == 0 and report.budget_violations == 0, policy
            assert lag.avg_jct_s <= report.avg_jct_all_s * (1 + 1e-9), (policy, lag)  # type: ignore[operator]


def test_lagrangian_bound_is_below_every_capped_policy_on_a_public_trace_slice(
    shared_data: Path,
) -> None:
    ef = shared_data / "elasticflow"
    jobs = load_trace(ef / "itp" / "cluster01.csv", limit=12)
    series = load_intensity_csv(shared_data / "carbon" / "electricitymaps" / "ES_2021_hourly.csv")
    profiles = load_scaling_profiles(ef / "throughputs_A100")
    base = SimulationConfig(
        "carbon-agnostic", 1, 8, horizon_slots=24, time_limit_s=0.5, best_effort=True
    )
    reference = simulate_trace(jobs, series, profiles, base)
    capped = replace(base, budget_kg=reference.emissions_kg * 0.5, budget_period="day")
    lp = avg_jct_lower_bound(jobs, series, profiles, capped)
    lag = avg_jct_lagrangian_bound(
        jobs, series, profiles, capped, horizon_s=lp.horizon_s, iterations=20
    )
    assert lag.avg_jct_s >= lp.avg_jct_s
    for policy in POLICIES:
        report = simulate_trace(jobs, series, profiles, replace(capped, policy=policy))
        assert report.unfinished == 0 and report.budget_violations == 0, policy
        assert lag.avg_jct_s <= report.avg_jct_all_s * (1 + 1e-9), (policy, lag)  # type: ignore[operator]
