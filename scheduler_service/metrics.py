"""Prometheus metrics: database and control-loop state read at scrape time, plus request counters."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.repository import NodeRepository

if TYPE_CHECKING:
    from scheduler_service.control_loop import ControlLoop

# AllocationPlan.status values: each is exposed (0 or 1) so a dashboard sees every series.
PLAN_STATUSES = ("optimal", "feasible", "heuristic", "baseline")


class DatabaseCollector(Collector):
    """Cluster gauges computed from the database on each scrape (no state kept in the process)."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self.session_factory = session_factory

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.session_factory() as session:
            counts = JobRepository(session).count_by_state()
            total, used = NodeRepository(session).gpu_counts()
        jobs = GaugeMetricFamily("greenflow_jobs", "Jobs by state", labels=["state"])
        for state in JobState:
            jobs.add_metric([state.value], counts.get(state.value, 0))
        yield jobs
        yield GaugeMetricFamily("greenflow_gpus_total", "GPUs on ready nodes", value=total)
        yield GaugeMetricFamily("greenflow_gpus_used", "GPUs holding a job", value=used)


class ControlLoopCollector(Collector):
    """The control loop's counters and last tick, read from its attributes (no query per scrape)."""

    def __init__(self, loop: ControlLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        loop = self.loop
        prefix = "greenflow_control_loop"
        yield CounterMetricFamily(f"{prefix}_ticks", "Ticks completed", value=loop.ticks)
        yield CounterMetricFamily(
            f"{prefix}_tick_failures",
            "Ticks that failed and were retried after a backoff",
            value=loop.tick_failures,
        )
        yield CounterMetricFamily(
            f"{prefix}_stale_replans",
            "Re-plans because a job changed while a tick planned (StaleDataError)",
            value=loop.stale_replans,
        )
        yield CounterMetricFamily(
            f"{prefix}_budget_wakes",
            "Ticks the budget watchdog asked for between slots",
            value=loop.budget_wakes,
        )
        yield GaugeMetricFamily(
            f"{prefix}_leader",
            "1 while this replica holds the leader lock and ticks, else 0",
            value=1 if loop.leader_since is not None else 0,
        )
        yield GaugeMetricFamily(
            f"{prefix}_last_tick_duration_seconds",
            "Duration of the last completed tick (forecast, solve, push)",
            value=loop.last_tick_s,
        )
        report = loop.last_report  # one read: the same tick's report for every series below
        if report is None:
            return
        if report.finished_at is not None:
            yield GaugeMetricFamily(
                f"{prefix}_last_tick_timestamp_seconds",
                "Unix time at which the last completed tick ended",
                value=report.finished_at.timestamp(),
            )
        yield GaugeMetricFamily(
            f"{prefix}_last_tick_jobs_planned",
            "Jobs the last completed tick planned",
            value=report.jobs_planned,
        )
        status = GaugeMetricFamily(
            f"{prefix}_last_plan_status",
            "Solver status of the last completed tick's plan (1: this status; all 0: no job to plan)",
            labels=["status"],
        )
        statuses: tuple[str, ...] = PLAN_STATUSES
        if report.plan_status is not None and report.plan_status not in statuses:
            statuses = (*statuses, report.plan_status)
        for name in statuses:
            status.add_metric([name], 1 if name == report.plan_status else 0)
        yield status
        if report.plan_gap is not None:
            yield GaugeMetricFamily(
                f"{prefix}_last_plan_gap_ratio",
                "Relative gap of the last plan to the solver's bound (absent: no bound known)",
                value=report.plan_gap,
            )
        if report.phases_s:
            phases = GaugeMetricFamily(
                f"{prefix}_last_tick_phase_seconds",
                "Seconds the last completed tick spent per phase (refits: waiting for the model "
                "refits the tick before started beside its solve; snapshot: read transaction; "
                "models: the problem; solve: the policy; write: plan and commands; dispatch: push)",
                labels=["phase"],
            )
            for name, seconds in report.phases_s.items():
                phases.add_metric([name], seconds)
            yield phases
        if report.phases_cpu_s:
            cpu = GaugeMetricFamily(
                f"{prefix}_last_tick_phase_cpu_seconds",
                "CPU seconds of the tick's own thread per phase of the last completed tick "
                "(snapshot, models, write): the rest of the phase's time it waited for the "
                "database, the GIL it shares with the API, or a busy CPU; refits: the refit "
                "thread's CPU for the refits the tick waited for",
                labels=["phase"],
            )
            for name, seconds in report.phases_cpu_s.items():
                cpu.add_metric([name], seconds)
            yield cpu
        if report.plan_solve_s is not None:
            yield GaugeMetricFamily(
                f"{prefix}_last_plan_solve_seconds",
                "Time the policy took to make the last plan",
                value=report.plan_solve_s,
            )
        if report.solve_cpu_s is not None:
            yield GaugeMetricFamily(
                f"{prefix}_last_solve_cpu_seconds",
                "CPU seconds of the last tick's solve (its wall time is the solve phase's): what "
                "the solver's step budget sized, apart from how loaded the machine was",
                value=report.solve_cpu_s,
            )


def make_registry(
    session_factory: sessionmaker[Session], loop: ControlLoop | None = None
) -> tuple[CollectorRegistry, Counter]:
    """A registry for one app: database gauges, the loop's metrics where it runs, request counts."""
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(session_factory))
    if loop is not None:
        registry.register(ControlLoopCollector(loop))
    requests = Counter(
        "greenflow_http_requests",
        "HTTP requests by method, route and status",
        ["method", "route", "status"],
        registry=registry,
    )
    return registry, requests
