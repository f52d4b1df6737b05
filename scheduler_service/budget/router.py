"""Budget endpoint: periods, spent and left."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from scheduler_service.budget.periods import period_containing
from scheduler_service.budget.repository import LedgerRepository
from scheduler_service.db.base import utcnow
from scheduler_service.deps import ConfigDep, SessionDep, UserOrOperator
from scheduler_service.exceptions import error_responses
from scheduler_service.ledger import period_status

router = APIRouter(prefix="/v1", tags=["budget"], responses=error_responses(401, 403))


class PeriodOut(BaseModel):
    """One budget period."""

    start_at: datetime
    end_at: datetime
    limit_kg_co2e: float
    spent_kg_co2e: float
    left_kg_co2e: float
    energy_kwh: float


class BudgetOut(BaseModel):
    """The budget configuration, the current period first, then earlier ones."""

    period: str
    enforcement: str
    limit_kg_co2e: float
    total_energy_kwh: float
    total_emissions_kg_co2e: float
    periods: list[PeriodOut]


@router.get("/budget")
def budget(
    session: SessionDep,
    config: ConfigDep,
    _caller: UserOrOperator,
    history: Annotated[int, Query(ge=0, le=366, description="Earlier periods to include.")] = 6,
) -> BudgetOut:
    """Budget periods with spent and left (the current one first)."""
    period = period_containing(utcnow(), config.budget.period)
    out = []
    for _ in range(history + 1):
        status = period_status(session, config, period)
        out.append(
            PeriodOut(
                start_at=status.start_at,
                end_at=status.end_at,
                limit_kg_co2e=status.limit_kg,
                spent_kg_co2e=status.spent_kg,
                left_kg_co2e=status.left_kg,
                energy_kwh=status.energy_kwh,
            )
        )
        period = period_containing(period.start_at - timedelta(seconds=1), config.budget.period)
    energy, emissions = LedgerRepository(session).totals()
    return BudgetOut(
        period=config.budget.period,
        enforcement=config.budget.enforcement,
        limit_kg_co2e=config.budget.limit_kg_co2e,
        total_energy_kwh=energy,
        total_emissions_kg_co2e=emissions,
        periods=out,
    )
