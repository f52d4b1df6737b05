"""Re-plan on change: a replay step where nothing happened keeps the plan in force, one slot on."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from energy_model.carbon.series import load_intensity_csv
from energy_model.profiles import load_scaling_profiles
from scheduler_service.allocation.policies import get_policy
from scheduler_service.allocation.problem import AllocationProblem, JobSpec
from scheduler_service.simulate.carry import carried_plan
from scheduler_service.simulate.engine import SimulationConfig, simulate_trace
from scheduler_service.simulate.trace import load_trace
from tests.simulate.test_simulate import write_profiles, write_series, write_trace

T0 = datetime(2021, 1, 1, tzinfo=UTC)
SLOT_S = 600.0


def _problem(start_at: datetime, remaining: dict[str, float]) -> AllocationProblem:
    """Two jobs on 4 GPUs (1 or 2 GPUs each: 10 or 18 samples/s), one due in 3 h."""
    jobs = tuple(
        JobSpec(
            job_id=job_id,
            allowed_gpus=(1, 2),
            throughput_samples_per_s=(10.0, 18.0),
            power_w=(300.0, 560.0),
            remaining_samples=samples,
            deadline_s=None if job_id == "free" else 3 * 3600.0 - (start_at - T0).total_seconds(),
        )
        for job_id, samples in remaining.items()
    )
    return AllocationProblem(
        start_at=start_at,
        slot_s=SLOT_S,
        capacity_gpus=(4,) * 24,
        intensity_g_per_kwh=tuple(200.0 + 20 * (i % 5) for i in range(24)),
        jobs=jobs,
    )


def test_a_plan_that_keeps_its_course_is_carried_one_slot_on_and_a_drifted_one_is_not() -> None:
    policy = get_policy("greenflow")
    first = _problem(T0, {"due": 100_000.0, "free": 150_000.0})
    plan = policy(first, previous=None, time_limit_s=0.5, seed=0)
    assert plan.deadline_met == {"due": True}
    # One slot later, each job having done what the plan's first slot gives it.
    done = {j: plan.gpus[j][0] and {1: 10.0, 2: 18.0}[plan.gpus[j][0]] * SLOT_S for j in plan.gpus}
    later = T0 + timedelta(seconds=SLOT_S)
    on_course = _problem(later, {"due": 100_000.0 - done["due"], "free": 150_000.0 - done["free"]})
    carried = carried_plan(on_course, plan)
    assert carried is not None and carried.step == "carried"
    assert carried.gpus == {j: (*g[1:], g[-1]) for j, g in plan.gpus.items()}
    assert carried.deadline_met == {"due": True}
    # The due job did nothing in that slot (a stall, a slow model): the plan no longer keeps its
    # course, so the replay solves.
    stalled = _problem(later, {"due": 100_000.0, "free": 150_000.0 - done["free"]})
    assert carried_plan(stalled, plan) is None
    # Not one whole slot on, or another set of jobs: solve.
    assert carried_plan(replace(on_course, start_at=later + timedelta(seconds=60)), plan) is None
    assert carried_plan(_problem(later, {"due": 90_000.0}), plan) is None
    assert carried_plan(on_course, None) is None


def test_a_replay_on_change_solves_less_and_keeps_every_promise(tmp_path: Path) -> None:
    profiles = load_scaling_profiles(write_profiles(tmp_path))
    series = load_intensity_csv(write_series(tmp_path, [100.0 + 40 * (i % 6) for i in range(48)]))
    # Jobs of 1-3 hours at 10-30 it/s arriving over an hour, two with deadlines.
    rows = [
        "a,0,108000,toy,14400,32,2,3600",
        "b,600,90000,toy,,32,2,3600",
        "c,1800,72000,toy,10800,32,1,3600",
        "d,3600,126000,toy,,32,4,3600",
    ]
    jobs = load_trace(write_trace(tmp_path, rows))
    base = SimulationConfig(
        policy="greenflow", num_nodes=1, gpus_per_node=4, slot_s=SLOT_S, horizon_slots=24,
        time_limit_s=0.2,
    )  # fmt: skip
    every = simulate_trace(jobs, series, profiles, base)
    on_change = simulate_trace(jobs, series, profiles, replace(base, replan="on-change"))
    assert every.plans_carried == 0
    assert on_change.plans_carried > 0
    assert on_change.ticks == every.ticks or on_change.plans_carried < on_change.ticks
    # Same jobs admitted, every admitted deadline kept, every job finished.
    assert [o.admitted for o in on_change.outcomes] == [o.admitted for o in every.outcomes]
    assert on_change.admitted_missed == 0 and every.admitted_missed == 0
    assert on_change.finished == on_change.admitted == every.finished
    # Under a budget every step solves: the period's spend is not what the carried plan saw.
    budgeted = simulate_trace(
        jobs,
        series,
        profiles,
        replace(base, replan="on-change", budget_kg=10.0, budget_period="day"),
    )
    assert budgeted.plans_carried == 0
