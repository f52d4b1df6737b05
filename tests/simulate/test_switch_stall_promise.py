"""Switch stalls are in the promise: plans count them, and a plan that only they make late is
padded on spare GPUs after its finish, or given more GPUs before it (issue 23)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from scheduler_service.allocation.problem import AllocationProblem, JobSpec, evaluate_gpus
from scheduler_service.allocation.stalls import pad_for_stalls

START = datetime(2021, 1, 1, tzinfo=UTC)


def _job(deadline_s: float, *, current: int = 0, started: bool = False) -> JobSpec:
    # 10 samples/s on 1 GPU, 20 on 2; 1,200 samples: 60 s at 2 GPUs.
    return JobSpec(
        job_id="a",
        allowed_gpus=(1, 2),
        throughput_samples_per_s=(10.0, 20.0),
        power_w=(100.0, 200.0),
        remaining_samples=1_200.0,
        deadline_s=deadline_s,
        current_gpus=current,
        started=started,
    )


def _problem(job: JobSpec, stall_s: float, slots: int = 4) -> AllocationProblem:
    return AllocationProblem(
        start_at=START,
        slot_s=60.0,
        capacity_gpus=(2,) * slots,
        intensity_g_per_kwh=(100.0,) * slots,
        jobs=(job,),
        switch_stall_s=stall_s,
    )


def test_a_count_change_stalls_the_job_in_the_plan() -> None:
    # Running on 1 GPU, switched to 2: without the stall it finishes at 60 s, with a 30 s stall
    # it does 600 samples in slot 0 and needs 30 s more in slot 1 (finish 90 s).
    job = _job(80.0, current=1, started=True)
    plain = evaluate_gpus(_problem(job, 0.0), {"a": (2, 2, 0, 0)})
    stalled = evaluate_gpus(_problem(job, 30.0), {"a": (2, 2, 0, 0)})
    assert plain.completion_s["a"] == pytest.approx(60.0)
    assert plain.deadline_met["a"]
    assert stalled.completion_s["a"] == pytest.approx(90.0)
    assert not stalled.deadline_met["a"]
    assert stalled.done_samples["a"] == pytest.approx(1_200.0)


def test_the_first_start_does_not_stall_but_a_resume_does() -> None:
    fresh = evaluate_gpus(_problem(_job(1e3), 30.0), {"a": (2, 0, 0, 0)})
    assert fresh.completion_s["a"] == pytest.approx(60.0)
    # Paused after slot 0 and resumed in slot 2: the resume stalls 30 s.
    paused = evaluate_gpus(_problem(_job(1e3), 30.0), {"a": (1, 0, 2, 0)})
    assert paused.completion_s["a"] == pytest.approx(120.0 + 30.0 + 600.0 / 20.0)
    # A job that ran before the problem's start stalls on its first slot back too.
    resumed = evaluate_gpus(_problem(_job(1e3, started=True), 30.0), {"a": (2, 0, 0, 0)})
    assert resumed.completion_s["a"] is None


def test_a_plan_late_only_by_its_stalls_is_padded_after_its_finish() -> None:
    job = _job(150.0, current=1, started=True)
    problem = _problem(job, 30.0)
    assert not evaluate_gpus(problem, {"a": (2, 0, 0, 0)}).deadline_met["a"]
    padded = pad_for_stalls(problem, {"a": (2, 0, 0, 0)})
    assert padded == {"a": (2, 2, 0, 0)}
    assert evaluate_gpus(problem, padded).deadline_met["a"]
    # Nothing to pad without a stall model, or when the plan meets the deadline already.
    assert pad_for_stalls(_problem(job, 0.0), {"a": (2, 0, 0, 0)}) is None
    assert pad_for_stalls(problem, {"a": (2, 2, 0, 0)}) is None


def test_a_plan_late_in_its_deadline_slot_runs_at_its_top_count_throughout() -> None:
    # 1 GPU then 2 (a 30 s stall in slot 1): finish 60 + 30 + 30 = 120 s, 90 s without the
    # stall; the deadline (110 s) lies in slot 1, so there is no slot to pad after the finish.
    job = _job(110.0)
    problem = _problem(job, 30.0)
    late: dict[str, tuple[int, ...]] = {"a": (1, 2, 0, 0)}
    assert evaluate_gpus(problem, late).completion_s["a"] == pytest.approx(120.0)
    padded = pad_for_stalls(problem, late)
    # At 2 GPUs from its first start: no change, no stall, done in slot 0 (slot 1 handed back).
    assert padded == {"a": (2, 0, 0, 0)}
    assert evaluate_gpus(problem, padded).deadline_met["a"]
    # No spare GPU in slot 0 and none above 2 in slot 1: nothing to be done.
    full = AllocationProblem(
        start_at=START,
        slot_s=60.0,
        capacity_gpus=(1, 2, 2, 2),
        intensity_g_per_kwh=(100.0,) * 4,
        jobs=(job,),
        switch_stall_s=30.0,
    )
    assert pad_for_stalls(full, late) is None
