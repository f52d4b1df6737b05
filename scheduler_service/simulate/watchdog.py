"""The service's budget watchdog as it runs, for the trace simulator (opt-in, `--watchdog-*`).

The simulator's default watchdog is ideal: a step ends exactly where the real spend reaches the
period's budget (`engine.budget_cut_s`). The service's (`scheduler_service/budget/watchdog.py`)
checks every `check_interval_s`, sees the spend only as far as the telemetry charged so far
tells, and its stop reaches the jobs only after the tick it wakes has run. This module replays
that with the service's own rules (`replan_reason`, `watch_lead_s`) on what the simulator knows:

- checks at the trace times k x `check_interval_s` (k = 0, 1, ...);
- the ledger at a check holds the real spend up to one telemetry interval before it (the
  newest report ends `telemetry_interval_s` earlier, the worst case the lead allows for), and
  the rate is the real draw over that newest report (real power at the real intensity, kg over
  its seconds); a check that finds no report since the last one does nothing (as the service's,
  which checks only when it charges new telemetry);
- the expectation is the plan's own predicted emissions per slot (the policy's model and
  forecast, so it may be wrong), with the ledger's spend when the plan was made;
- a check whose rule fires wakes a tick that takes `tick_s`; its stop takes effect then: the
  simulator re-plans at check + `tick_s`, and the jobs ran (and spent) until that moment;
- while a stop is on its way no check wakes another (the loop wakes once per plan).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from scheduler_service.allocation.problem import AllocationPlan
from scheduler_service.allocation.snapshot import BudgetWindow
from scheduler_service.budget.periods import PeriodStatus
from scheduler_service.budget.watchdog import SpendExpectation, replan_reason, watch_lead_s

# A budget period that never ends (`--budget-period run`) ends this far after the origin.
_FOREVER = timedelta(days=365 * 1000)


@dataclass
class RealisticWatchdog:
    """State of the modelled watchdog over one replay (see the module docstring)."""

    check_interval_s: float
    telemetry_interval_s: float
    tick_s: float
    # kg CO2e per W drawn over trace interval [start_s, end_s) (the replay's CarbonClock).
    kg_per_w: Callable[[float, float], float]
    origin: datetime
    # (start_s, end_s, real power_w) of what jobs drew lately (pruned as the replay moves on).
    history: list[tuple[float, float, float]] = field(default_factory=list)
    # When the stop of the last wake takes effect (None: no wake pending).
    stop_at_s: float | None = None
    wakes: int = 0

    @property
    def lead_s(self) -> float:
        """What the service looks ahead: one check + one report + the tick's time."""
        return watch_lead_s(self.check_interval_s, self.telemetry_interval_s, self.tick_s)

    def step_s(
        self,
        plan: AllocationPlan,
        period: BudgetWindow | None,
        spent_kg: float,
        now: float,
        step_s: float,
        runs: list[tuple[float, float]],
    ) -> float:
        """How long the step from `now` lasts: `step_s`, or less where a wake's stop ends it.

        `plan` is the plan just made at `now`; `period` the current budget period with `spent_kg` charged to it before `now` (None: no budget); `runs`
        holds (real power_w, s until it finishes) per running job. The caller records what the
        step really ran with `ran`.
        """
        if period is None:
            return step_s
        begin, end, share_kg = period.start_s, period.end_s, period.budget_kg
        # Each period is watched on its own: the step stops at its end, where the next plan
        # starts on the new budget (so no step is charged to two periods).
        step_s = min(step_s, end - now)
        if self.stop_at_s is not None and self.stop_at_s <= now + 1e-9:
            self.stop_at_s = None  # the plan made now is the one the wake asked for
        if self.stop_at_s is not None:
            # A wake's tick is still running: its stop ends this step, and nothing else wakes.
            if self.stop_at_s <= now + step_s + 1e-9:
                step_s = self.stop_at_s - now
                self.stop_at_s = None
            return step_s
        current = [(now, now + need_s, power_w) for power_w, need_s in runs if need_s > 0]
        segments = self.history + current

        def kg(start_s: float, end_s: float) -> float:
            total = 0.0
            for seg_start, seg_end, power_w in segments:
                lo, hi = max(start_s, seg_start), min(end_s, seg_end)
                if hi > lo:
                    total += power_w * self.kg_per_w(lo, hi)
            return total

        def ledger_kg(at_s: float) -> float:
            """What the ledger holds for the period at `at_s`: spend up to one report earlier."""
            seen_s = at_s - self.telemetry_interval_s
            if seen_s >= now:
                return spent_kg + kg(max(now, begin), seen_s)
            return max(0.0, spent_kg - kg(max(seen_s, begin), now))

        expectation = SpendExpectation.of_plan(
            plan, self._status(begin, end, share_kg, ledger_kg(now))
        )
        check_s = math.ceil(now / self.check_interval_s - 1e-9) * self.check_interval_s
        while check_s < now + step_s - 1e-9:
            seen_s = check_s - self.telemetry_interval_s
            reports = any(
                seg_end > seen_s - self.check_interval_s and seg_start < seen_s
                for seg_start, seg_end, _ in segments
            )
            if reports:
                rate = kg(seen_s - self.telemetry_interval_s, seen_s) / self.telemetry_interval_s
                reason = replan_reason(
                    self._status(begin, end, share_kg, ledger_kg(check_s)),
                    expectation,
                    self._at(check_s),
                    rate_kg_per_s=rate,
                    lead_s=self.lead_s,
                )
                if reason is not None:
                    self.wakes += 1
                    stop_at_s = check_s + self.tick_s
                    if stop_at_s <= now + step_s + 1e-9:
                        return stop_at_s - now
                    # The stop lands after this step's own end (an event, the slot's end):
                    # the next step ends there.
                    self.stop_at_s = stop_at_s
                    return step_s
            check_s += self.check_interval_s
        return step_s

    def ran(self, now: float, runs: list[tuple[float, float]]) -> None:
        """Record what the step from `now` drew: (real power_w, seconds it ran) per job."""
        self.history.extend((now, now + run_s, power_w) for power_w, run_s in runs if run_s > 0)
        # Checks look back at most one check interval and two reports from the next step.
        keep_from = now - self.check_interval_s - 2 * self.telemetry_interval_s
        self.history = [seg for seg in self.history if seg[1] > keep_from]

    def _at(self, at_s: float) -> datetime:
        return self.origin + timedelta(seconds=at_s)

    def _status(self, begin: float, end: float, share_kg: float, spent_kg: float) -> PeriodStatus:
        end_at = self._at(end) if math.isfinite(end) else self.origin + _FOREVER
        return PeriodStatus(
            start_at=self._at(begin),
            end_at=end_at,
            limit_kg=share_kg,
            spent_kg=spent_kg,
            energy_kwh=0.0,
        )
