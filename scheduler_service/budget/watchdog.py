"""The budget watchdog: between ticks, tell when the measured spend puts a hard budget at risk.

A plan keeps each period within its budget for the *predicted* power and intensity. When the
jobs draw more than their models said, or the grid is dirtier than forecast, the ledger can pass
the budget before the next slot's tick re-plans. The control loop's carbon sampler charges new
telemetry several times a slot and asks `replan_reason`; a reason wakes the tick at once, and the
new plan sees what is really left. Waking only once the budget is spent would leave the jobs
running until the stop reaches them, so the watchdog also wakes when, at the rate jobs spend now,
the budget would run out before the stop of a tick started at the next check could.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from scheduler_service.allocation.problem import AllocationPlan
from scheduler_service.budget.periods import PeriodStatus

# Spending above the plan by less than this share of the plan is noise, not a reason to re-plan.
SPEND_TOLERANCE = 0.1


@dataclass(frozen=True)
class SpendExpectation:
    """What the last plan expects the current budget period to spend, and from which ledger state."""

    period_start_at: datetime
    period_end_at: datetime
    spent_at_plan_kg: float
    plan_start_at: datetime
    slot_s: float
    planned_kg_per_slot: tuple[float, ...]

    @classmethod
    def of_plan(cls, plan: AllocationPlan, period: PeriodStatus) -> SpendExpectation:
        """The expectation of `plan`, made when `period` had spent what it shows."""
        return cls(
            period_start_at=period.start_at,
            period_end_at=period.end_at,
            spent_at_plan_kg=period.spent_kg,
            plan_start_at=plan.start_at,
            slot_s=plan.slot_s,
            planned_kg_per_slot=tuple(plan.emissions_kg_per_slot),
        )

    @classmethod
    def of_nothing(cls, now: datetime, slot_s: float, period: PeriodStatus) -> SpendExpectation:
        """The expectation of a tick that planned no job, made when `period` had spent what it shows."""
        return cls(
            period_start_at=period.start_at,
            period_end_at=period.end_at,
            spent_at_plan_kg=period.spent_kg,
            plan_start_at=now,
            slot_s=slot_s,
            planned_kg_per_slot=(),
        )

    def planned_kg_between(self, start_at: datetime, end_at: datetime) -> float:
        """Planned kg over [start_at, end_at), clipped to the period (slots by time share)."""
        lo = max(start_at, self.plan_start_at, self.period_start_at)
        hi = min(end_at, self.period_end_at)
        if hi <= lo:
            return 0.0
        lo_s = (lo - self.plan_start_at).total_seconds()
        hi_s = (hi - self.plan_start_at).total_seconds()
        total = 0.0
        for t, kg in enumerate(self.planned_kg_per_slot):
            overlap_s = min(hi_s, (t + 1) * self.slot_s) - max(lo_s, t * self.slot_s)
            if overlap_s > 0:
                total += kg * overlap_s / self.slot_s
        return total


def watch_lead_s(check_interval_s: float, telemetry_interval_s: float, tick_s: float) -> float:
    """Seconds from a budget check until a stop decided at the next check has reached the agents."""
    # The next check comes one interval later; the spend it sees lags the draw by up to one
    # telemetry report; the tick it wakes then needs its own time to solve and push the stop.
    return check_interval_s + telemetry_interval_s + tick_s


def replan_reason(
    status: PeriodStatus,
    expectation: SpendExpectation | None,
    now: datetime,
    *,
    rate_kg_per_s: float = 0.0,
    lead_s: float = 0.0,
) -> str | None:
    """Why the spend measured so far needs a new plan now (None when it does not)."""
    if expectation is not None and expectation.period_start_at != status.start_at:
        expectation = None  # made in an earlier period: it says nothing about this one
    if status.spent_kg >= status.limit_kg:
        if expectation is not None and expectation.spent_at_plan_kg >= status.limit_kg:
            return None  # the plan in force already knew the budget was spent
        return (
            f"the budget of the period from {status.start_at.isoformat()} is spent "
            f"({status.spent_kg:.6g} of {status.limit_kg:.6g} kg)"
        )
    reason = _runs_out_within_lead(status, expectation, now, rate_kg_per_s, lead_s)
    if reason is not None:
        return reason
    if expectation is None:
        return None  # no plan for this period yet: the slot's tick plans it
    expected_kg = expectation.planned_kg_between(expectation.plan_start_at, now)
    actual_kg = status.spent_kg - expectation.spent_at_plan_kg
    if expected_kg <= 0 or actual_kg <= expected_kg * (1 + SPEND_TOLERANCE):
        return None
    # At the measured rate over the plan's, what the plan allows for the rest of the period.
    ratio = actual_kg / expected_kg
    rest_kg = expectation.planned_kg_between(now, status.end_at) * ratio
    if status.spent_kg + rest_kg <= status.limit_kg:
        return None
    return (
        f"jobs spend {ratio:.2f}x what the plan expected ({actual_kg:.6g} vs "
        f"{expected_kg:.6g} kg since it began): at that rate the period's "
        f"{status.limit_kg:.6g} kg budget would be overspent"
    )


def _runs_out_within_lead(
    status: PeriodStatus,
    expectation: SpendExpectation | None,
    now: datetime,
    rate_kg_per_s: float,
    lead_s: float,
) -> str | None:
    """Why the budget would be spent before a stop decided at the next check takes effect."""
    if lead_s <= 0:
        return None
    planned_kg = 0.0
    if expectation is not None:
        planned_kg = expectation.planned_kg_between(now, now + timedelta(seconds=lead_s))
    # The measured rate, or the plan's where it is higher (a job the plan has just grown).
    lead_kg = max(rate_kg_per_s * lead_s, planned_kg)
    if status.spent_kg + lead_kg < status.limit_kg:
        return None
    if expectation is not None and expectation.spent_at_plan_kg + lead_kg >= status.limit_kg:
        # The plan in force was made with no more than this left: it is the plan for the end of
        # the budget already (once per plan, as for a spent budget).
        return None
    return (
        f"at {lead_kg / lead_s:.6g} kg/s the budget of the period from "
        f"{status.start_at.isoformat()} would be spent within {lead_s:.0f} s "
        f"({status.spent_kg:.6g} of {status.limit_kg:.6g} kg), before a later check could stop it"
    )
