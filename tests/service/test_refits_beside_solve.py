"""The control loop's model refits run beside the solve, off the tick's path: a tick plans with
each job's model as it stood (a just-started job's prior) and starts the refits its snapshot left
due in the refit thread; the next tick waits for them before reading telemetry and plans with the
refitted models."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from energy_model.job_model import JobModel, JobModelFitter, TelemetryPoint, prior_job_model
from scheduler_service.control_loop import ControlLoop
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import TelemetrySample
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from scheduler_service.planning import JobModels
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.service.test_budget_watchdog import _add_job, _config
from tests.support.rows import add_node


def _point(gpus: int, samples_per_s: float) -> TelemetryPoint:
    return TelemetryPoint(
        gpus=gpus, samples_per_s=samples_per_s, power_w=300.0 * gpus, at=utcnow(), layout=None
    )


def test_deferred_models_answer_at_once_and_refit_when_asked() -> None:
    models = JobModels(deferred=True)
    prior = prior_job_model("resnet50", 256, (1, 2, 4))
    models.fitters[1] = JobModelFitter(prior)
    models.waiting[1] = [_point(2, 900.0)]
    # The refit due is left for later: the job is planned on its prior meanwhile.
    assert models.fitted([1])[1] is prior
    assert models.due == [1] and models.refits == 0
    assert models.refit_due() == 1
    assert models.due == [] and models.refits == 1 and not models.waiting
    refitted = models.fitted([1])[1]
    assert refitted is not prior and refitted.source == "fitted"
    # Nothing new: nothing due.
    assert models.due == [] and models.refit_due() == 0


@dataclass
class WatchedModels(JobModels):
    """The loop's models, noting which models each snapshot got and where refits ran."""

    sources: list[str] = field(default_factory=list)
    refit_threads: list[str] = field(default_factory=list)

    def fitted(self, job_ids: Iterable[int]) -> dict[int, JobModel]:
        out = super().fitted(job_ids)
        self.sources += [model.source for model in out.values()]
        return out

    def refit_due(self) -> int:
        self.refit_threads.append(threading.current_thread().name)
        return super().refit_due()


def test_a_tick_plans_on_the_prior_and_the_next_on_the_refit_done_beside_the_solve(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()
    config = _config(limit_kg=1000.0)
    loop = ControlLoop(config, factory, engine)
    models = WatchedModels(
        refit_interval_s=config.planner.model_refit_interval_s,
        max_refits=config.planner.model_refits_per_tick,
        deferred=True,
    )
    loop.models = models
    try:
        with transaction(factory) as session:
            add_node(session, "n1", 8, last_heartbeat_at=now)
        job_id = _add_job(
            factory, name="started", total_samples=10**9, state=JobState.RUNNING.value,
            state_reason="running", created_at=now, updated_at=now,
        )  # fmt: skip
        with transaction(factory) as session:
            session.add_all(
                TelemetrySample(
                    sample_id=f"s{k}",
                    job_id=job_id,
                    at=now - timedelta(seconds=5 * k),
                    interval_s=5.0,
                    step=k,
                    samples_done=0,
                    samples_per_s=700.0,
                    gpus=2,
                    power_w=600.0,
                    energy_kwh=0.0,
                    power_source="nvml",
                )
                for k in range(3)
            )
        forecast = asyncio.run(loop.carbon.get_forecast(config.planner.horizon_s))

        first_phases: dict[str, float] = {}
        first_cpu: dict[str, float] = {}
        assert loop._plan(forecast, utcnow(), first_phases, first_cpu)[0] == 1
        # Its first samples arrived, yet this tick planned the job on its prior and left the fit
        # to the refit thread.
        assert models.sources == ["prior"]
        refitting = loop._refitting
        assert refitting is not None
        refitting.result(timeout=60)
        assert models.refit_threads and models.refit_threads[0].startswith("greenflow-refit")
        assert "refits" not in first_cpu

        second_phases: dict[str, float] = {}
        second_cpu: dict[str, float] = {}
        loop._plan(forecast, utcnow(), second_phases, second_cpu)
        # The next tick collected that refit (its CPU reported) and planned on it.
        assert second_cpu["refits"] > 0 and "refits" in second_phases
        assert models.sources == ["prior", "fitted"]
        assert models.refits == 1 and loop._refitting is None
    finally:
        asyncio.run(loop.carbon.aclose())
        asyncio.run(loop.agents.aclose())
        loop._refit_pool.shutdown(wait=True)
        engine.dispose()
