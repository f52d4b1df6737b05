"""Prometheus metrics: read from the database at scrape time, plus request counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.repository import NodeRepository


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


def make_registry(session_factory: sessionmaker[Session]) -> tuple[CollectorRegistry, Counter]:
    """A registry for one app, with the database collector and an HTTP request counter."""
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(session_factory))
    requests = Counter(
        "greenflow_http_requests",
        "HTTP requests by method, route and status",
        ["method", "route", "status"],
        registry=registry,
    )
    return registry, requests
