"""Prometheus series of the carbon budget and the ledger, computed from the database per scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from scheduler_service.budget.ledger import budget_period, period_status
from scheduler_service.budget.repository import LedgerRepository
from scheduler_service.db.base import utcnow
from scheduler_service.settings import GreenflowConfig

CLUSTER_BUDGET = "cluster"
COMPONENTS = ("gpu", "idle", "host")


def _gauges(metric: str, documentation: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(metric, documentation, labels=["budget"])


class BudgetCollector(Collector):
    """Each budget's current period (the cluster's as budget="cluster", each team's by name:
    limit, emissions, energy by component) and the ledger's running totals, read from the
    database at scrape time."""

    def __init__(
        self, session_factory: sessionmaker[Session], config: Callable[[], GreenflowConfig]
    ) -> None:
        self.session_factory = session_factory
        self.config = config

    def collect(self) -> Iterator[Metric]:
        config = self.config()
        now = utcnow()
        period = budget_period(config, now)
        budgets: list[tuple[str, list[str] | None]] = [(CLUSTER_BUDGET, None)]
        budgets += [(team, b.queues) for team, b in config.budget.teams.items()]
        with self.session_factory() as session:
            ledger = LedgerRepository(session)
            statuses = {
                name: period_status(session, config, period, None if queues is None else name)
                for name, queues in budgets
            }
            by_component = {
                name: {
                    c: (e, k)
                    for c, e, k in ledger.totals_by_component(
                        period.start_at, period.end_at, queues
                    )
                }
                for name, queues in budgets
            }
            totals = {c: (e, k) for c, e, k in ledger.all_time_by_component()}
        limit = _gauges(
            "greenflow_budget_limit_kg",
            "Emissions the budget allows in its current period (kg CO2e)",
        )
        spent = _gauges(
            "greenflow_budget_emissions_kg",
            "Emissions charged to the budget's current period (kg CO2e)",
        )
        left = _gauges(
            "greenflow_budget_remaining_kg",
            "Emissions left in the budget's current period (kg CO2e, never negative)",
        )
        ends = _gauges(
            "greenflow_budget_period_end_timestamp_seconds",
            "Unix time the budget's current period ends",
        )
        energy = GaugeMetricFamily(
            "greenflow_budget_energy_kwh",
            "Facility energy (IT x PUE) charged to the budget's current period, by component "
            "(gpu: jobs' GPUs; idle: GPUs no job held; host); a team's budget counts its "
            "queues' jobs, their idle and host shares included",
            labels=["budget", "component"],
        )
        for name, status in statuses.items():
            limit.add_metric([name], status.limit_kg)
            spent.add_metric([name], status.spent_kg)
            left.add_metric([name], status.left_kg)
            ends.add_metric([name], status.end_at.timestamp())
            for component in COMPONENTS:
                value = by_component[name].get(component, (0.0, 0.0))[0]
                energy.add_metric([name, component], value)
        yield from (limit, spent, left, ends, energy)
        emissions_total = CounterMetricFamily(
            "greenflow_ledger_emissions_kg",
            "Emissions charged to the ledger since it began, by component (kg CO2e)",
            labels=["component"],
        )
        energy_total = CounterMetricFamily(
            "greenflow_ledger_energy_kwh",
            "Facility energy charged to the ledger since it began, by component (kWh)",
            labels=["component"],
        )
        for component in COMPONENTS:
            kwh, kg = totals.get(component, (0.0, 0.0))
            emissions_total.add_metric([component], kg)
            energy_total.add_metric([component], kwh)
        yield emissions_total
        yield energy_total
