"""Budget endpoint: periods, spent and left."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from scheduler_service.budget.ledger import budget_period, period_status, team_statuses
from scheduler_service.budget.periods import PeriodStatus
from scheduler_service.budget.report import GroupBy, build_report, report_csv
from scheduler_service.budget.repository import LedgerRepository
from scheduler_service.db.base import utcnow
from scheduler_service.deps import ConfigDep, SessionDep, UserOrOperator
from scheduler_service.exceptions import error_responses

router = APIRouter(prefix="/v1", tags=["budget"], responses=error_responses(401, 403))


class PeriodOut(BaseModel):
    """One budget period."""

    start_at: datetime
    end_at: datetime
    limit_kg_co2e: float
    spent_kg_co2e: float
    left_kg_co2e: float
    energy_kwh: float


class TeamBudgetOut(BaseModel):
    """A team's budget and its current period."""

    name: str
    queues: list[str]
    enforcement: str
    current: PeriodOut


def _period_out(status: PeriodStatus) -> PeriodOut:
    return PeriodOut(
        start_at=status.start_at,
        end_at=status.end_at,
        limit_kg_co2e=status.limit_kg,
        spent_kg_co2e=status.spent_kg,
        left_kg_co2e=status.left_kg,
        energy_kwh=status.energy_kwh,
    )


class BudgetOut(BaseModel):
    """The budget configuration, the current period first, then earlier ones."""

    period: str
    enforcement: str
    limit_kg_co2e: float
    total_energy_kwh: float
    total_emissions_kg_co2e: float
    periods: list[PeriodOut]
    time_zone: str
    """Periods start at local midnight of this zone."""
    teams: list[TeamBudgetOut]
    """Team budgets under the cluster's (users see those of their jobs' queues)."""


@router.get("/budget")
def budget(
    session: SessionDep,
    config: ConfigDep,
    caller: UserOrOperator,
    history: Annotated[int, Query(ge=0, le=366, description="Earlier periods to include.")] = 6,
) -> BudgetOut:
    """Budget periods with spent and left (the current one first), and each team's budget."""
    now = utcnow()
    period = budget_period(config, now)
    out = []
    for _ in range(history + 1):
        out.append(_period_out(period_status(session, config, period)))
        period = budget_period(config, period.start_at - timedelta(seconds=1))
    ledger = LedgerRepository(session)
    energy, emissions = ledger.totals()
    visible = None if caller.is_operator else ledger.queues_of_owner(caller.name)
    teams = [
        TeamBudgetOut(
            name=team,
            queues=config.budget.teams[team].queues,
            enforcement=config.budget.teams[team].enforcement,
            current=_period_out(status),
        )
        for team, status in team_statuses(session, config, now).items()
        if visible is None or visible & set(config.budget.teams[team].queues)
    ]
    return BudgetOut(
        period=config.budget.period,
        enforcement=config.budget.enforcement,
        limit_kg_co2e=config.budget.limit_kg_co2e,
        total_energy_kwh=energy,
        total_emissions_kg_co2e=emissions,
        periods=out,
        time_zone=config.budget.time_zone,
        teams=teams,
    )


@router.get("/report", responses=error_responses(400))
def report(
    session: SessionDep,
    config: ConfigDep,
    caller: UserOrOperator,
    period: Annotated[
        str, Query(max_length=10, description="A month YYYY-MM or a day YYYY-MM-DD (UTC).")
    ],
    by: Annotated[GroupBy, Query(description="Sum per job, queue or user.")] = "job",
    format: Annotated[Literal["json", "csv"], Query()] = "json",
) -> Any:
    """Energy (GPU, idle, host, PUE overhead), emissions, intensity source and measured share of
    a period per job, queue or user; users see only their own jobs' rows."""
    result = build_report(
        session, config, period, by, owner=None if caller.is_operator else caller.name
    )
    if format == "csv":
        filename = f"greenflow-report-{period}-by-{by}.csv"
        return PlainTextResponse(
            report_csv(result),
            media_type="text/csv",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )
    return result.as_json()
