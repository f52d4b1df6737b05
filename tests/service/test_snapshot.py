"""The one problem builder (pure) and the live snapshot read (a fixed number of queries)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, event
from sqlalchemy.orm.exc import StaleDataError

from energy_model.carbon.forecast import CarbonForecast, ForecastPoint, PointKind, Signal
from energy_model.job_model import JobModelFitter, TelemetryPoint, prior_job_model
from scheduler_service.allocation.problem import BudgetMode
from scheduler_service.allocation.snapshot import (
    BudgetWindow,
    ClusterSnapshot,
    PlannableJob,
    ProblemKnobs,
    build_problem,
    plan_job,
)
from scheduler_service.db.models import Job, TelemetrySample
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.service import planned_rows
from scheduler_service.jobs.states import JobState
from scheduler_service.planning import JobModels, read_snapshot
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.service.test_budget_watchdog import _add_job, _config
from tests.support.rows import add_node

NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)


def _job(**fields: Any) -> PlannableJob:
    base: dict[str, Any] = {
        "job_id": "a",
        "allowed_gpus": (1, 2, 4),
        "throughput_samples_per_s": (10.0, 19.0, 36.0),
        "power_w": (300.0, 600.0, 1200.0),
        "remaining_samples": 36_000.0,
    }
    return PlannableJob(**(base | fields))


def test_the_builder_applies_one_rule_for_priority_margin_change_cost_and_counts() -> None:
    # 36,000 samples take 1,000 s at the fastest count.
    knobs = ProblemKnobs(deadline_margin_s=60.0, change_cost_s=30.0)
    roomy = plan_job(_job(deadline_s=2_000.0, priority=3, current_gpus=2), knobs)
    assert roomy.deadline_s == pytest.approx(1_940.0)
    assert roomy.priority == 4.0 and roomy.current_gpus == 2
    # No margin where it would turn a just-meetable deadline into a lost one.
    tight = plan_job(_job(deadline_s=1_030.0), knobs)
    assert tight.deadline_s == pytest.approx(1_030.0)
    # A count outside the allowed ones (the node shrank) restarts the job.
    assert plan_job(_job(current_gpus=8), knobs).current_gpus == 0
    snapshot = ClusterSnapshot(
        start_at=NOW,
        slot_s=300.0,
        num_slots=4,
        node_gpus=(4, 8),
        intensity_g_per_kwh=(100.0, 200.0, 300.0, 400.0),
        jobs=(_job(), _job(job_id="b", requested_gpus=2)),
        budget_windows=(BudgetWindow(-60.0, 3_600.0, 0.5),),
    )
    problem = build_problem(snapshot, knobs)
    assert problem.capacity_gpus == (12,) * 4
    assert problem.change_cost_s == 30.0 and problem.budget_mode is BudgetMode.HARD
    assert [j.fixed_gpus for j in problem.jobs] == [4, 2]
    assert problem.budget_periods[0].budget_left_kg == 0.5
    # A change is never free: equal plans prefer the stable one.
    assert build_problem(snapshot, ProblemKnobs(change_cost_s=0.0)).change_cost_s == 1.0


@contextmanager
def _count_selects(engine: Engine) -> Iterator[list[str]]:
    statements: list[str] = []

    def before(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            statements.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", before)


def _forecast() -> CarbonForecast:
    return CarbonForecast(
        region="test",
        source="test",
        signal=Signal.AVERAGE,
        fetched_at=NOW,
        points=(
            ForecastPoint(
                at=NOW - timedelta(hours=1), intensity_g_per_kwh=200.0, kind=PointKind.FORECAST
            ),
        ),
    )


def test_the_snapshot_reads_jobs_and_their_telemetry_in_a_fixed_number_of_queries(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = _config(limit_kg=10.0)
    with transaction(factory) as session:
        add_node(session, "n1", 8, last_heartbeat_at=NOW)

    def add_jobs(count: int, first: int) -> list[int]:
        ids = []
        for i in range(first, first + count):
            ids.append(
                _add_job(
                    factory,
                    name=f"j{i}",
                    state=JobState.RUNNING.value,
                    state_reason="running",
                    total_samples=10_000_000,
                    created_at=NOW,
                    updated_at=NOW,
                )
            )
        with transaction(factory) as session:
            for job_id in ids:
                for k in range(3):
                    session.add(
                        TelemetrySample(
                            sample_id=f"s-{job_id}-{k}",
                            job_id=job_id,
                            at=NOW - timedelta(seconds=30 - 5 * k),
                            interval_s=5.0,
                            step=k,
                            samples_done=0,
                            samples_per_s=900.0,
                            gpus=4,
                            power_w=1000.0,
                            energy_kwh=0.0,
                            power_source="nvml",
                        )
                    )
        return ids

    loaded: list[int] = []

    def on_load(job: Job, _context: Any) -> None:
        loaded.append(job.id)

    def read(models: JobModels) -> tuple[int, int]:
        event.listen(Job, "load", on_load)
        try:
            with _count_selects(engine) as selects, transaction(factory) as session:
                planning = read_snapshot(session, config, _forecast(), models, NOW)
        finally:
            event.remove(Job, "load", on_load)
        return len(planning.problem.jobs), len(selects)

    try:
        add_jobs(2, 0)
        models = JobModels()
        planned_few, _ = read(models)
        # Telemetry reached the models: the fit moved off the prior.
        fitter = next(iter(models.fitters.values()))
        assert len(fitter.samples) == 3 and fitter.model is not fitter.prior
        _, queries_few = read(models)
        add_jobs(20, 2)
        # New jobs' history: one more query for all of them.
        planned_many, queries_new = read(models)
        _, queries_many = read(models)
        assert (planned_few, planned_many) == (2, 22)
        # Eleven times the jobs, the same number of SELECTs (no query per job).
        assert queries_many == queries_few and queries_new == queries_few + 1
        # Each read took only what was new: no sample is fitted twice.
        assert all(len(f.samples) == 3 for f in models.fitters.values())
        # The planned jobs were read as plain rows: not one loaded as an ORM object.
        assert loaded == []
    finally:
        engine.dispose()


def test_progress_between_snapshot_and_write_is_no_conflict_but_a_changed_state_is(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = _config(limit_kg=10.0)
    with transaction(factory) as session:
        add_node(session, "n1", 8, last_heartbeat_at=NOW)
    job_id = _add_job(
        factory,
        name="a",
        state=JobState.RUNNING.value,
        state_reason="running",
        total_samples=10_000_000,
        created_at=NOW,
        updated_at=NOW,
    )

    def snapshot() -> Any:
        with transaction(factory) as session:
            return read_snapshot(session, config, _forecast(), JobModels(), NOW)

    def change(**fields: Any) -> None:
        with transaction(factory) as session:
            job = session.get(Job, job_id)
            assert job is not None
            for key, value in fields.items():
                setattr(job, key, value)

    def write(planning: Any, reason: str) -> None:
        # What the write step does to a job whose placement changes: it writes the row.
        with transaction(factory) as session:
            row = planned_rows(session, planning)[job_id]
            row.state_reason = reason

    try:
        # Telemetry moved the job on while the tick solved: the tick's write still goes in.
        planning = snapshot()
        change(samples_done=1_000, step=10)
        write(planning, "resizing")
        # The job was held meanwhile: the plan is stale, the write fails, the loop plans again.
        planning = snapshot()
        change(held=True)
        with pytest.raises(StaleDataError):
            write(planning, "resizing again")
    finally:
        engine.dispose()


def test_refits_wait_for_their_interval_and_a_tick_does_a_bounded_number() -> None:
    models = JobModels(refit_interval_s=3_600.0, max_refits=1)
    for job_id in (1, 2):
        models.fitters[job_id] = JobModelFitter(prior_job_model("resnet50", 256, (1, 2, 4)))
        models.waiting[job_id] = [
            TelemetryPoint(gpus=2, samples_per_s=900.0, power_w=600.0, at=NOW, layout=None)
        ]
    models.fitted([1, 2])
    assert models.refits == 1 and list(models.waiting) == [2]
    # The one that waited goes first next time.
    models.fitted([1, 2])
    assert models.refits == 2 and not models.waiting
    # New samples of a job refitted within the interval wait in its buffer.
    models.waiting[1] = [
        TelemetryPoint(gpus=4, samples_per_s=1_700.0, power_w=1_200.0, at=NOW, layout=None)
    ]
    fitted = models.fitted([1, 2])
    assert models.refits == 2 and list(models.waiting) == [1]
    assert fitted[1] is models.fitters[1].model
