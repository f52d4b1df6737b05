"""The control loop: every slot (and at once on events) forecast -> fit -> solve -> place -> push."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from energy_model.carbon.forecast import CarbonForecast
from energy_model.carbon.resilient import ResilientCarbonSource
from scheduler_service.allocation.policies import get_policy
from scheduler_service.allocation.problem import AllocationPlan
from scheduler_service.budget.watchdog import SpendExpectation, replan_reason, watch_lead_s
from scheduler_service.carbon.service import (
    anchor_replay,
    make_carbon_source,
    record_forecast,
    record_intensity_now,
)
from scheduler_service.db.base import utcnow
from scheduler_service.db.session import run_in_transaction, transaction
from scheduler_service.dispatch import service as dispatch
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.leader import LeaderLock
from scheduler_service.ledger import charge_new_telemetry, current_period
from scheduler_service.nodes.agent_client import AgentClient, AgentRejected, AgentUnreachable
from scheduler_service.nodes.service import mark_lost_nodes
from scheduler_service.planning import JobModels, build_problem, plan_row
from scheduler_service.settings import GreenflowConfig

log = logging.getLogger("greenflow.loop")

PLANS_KEPT = 500
# Conflicts in a row (a job changed while the tick planned) that are planned again at once; the
# next one fails the tick, so a job that changes continuously meets the backoff, not a spin.
STALE_REPLANS_AT_ONCE = 3


@dataclass(frozen=True)
class TickReport:
    """What one tick did."""

    at: datetime
    jobs_planned: int
    commands: int
    acked: int
    failed: int
    forecast_degraded: bool
    plan_status: str | None  # None: no job to plan
    plan_gap: float | None = None  # relative gap to the solver's bound (None: none known)
    plan_solve_s: float | None = None
    finished_at: datetime | None = None


class ControlLoop:
    """Runs ticks while this replica holds the leader lock."""

    def __init__(
        self,
        config: GreenflowConfig,
        session_factory: sessionmaker[Session],
        engine: Engine,
        policy: str | None = None,
        carbon: ResilientCarbonSource | None = None,
    ) -> None:
        self.config = config
        self.session_factory = session_factory
        self.carbon = carbon or make_carbon_source(config.carbon)
        self.policy_name = policy or config.planner.policy
        self.policy = get_policy(self.policy_name)
        self.models = JobModels()
        self.previous: AllocationPlan | None = None
        self.agents = AgentClient()
        self.leader = LeaderLock(engine)
        self.wake_event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        # Counters and the last tick, read by metrics.ControlLoopCollector at each scrape.
        self.ticks = 0
        self.tick_failures = 0
        self.stale_replans = 0
        self.last_report: TickReport | None = None
        # Charging telemetry happens in the tick and in the budget watchdog (worker threads):
        # one at a time, or both would charge the same samples and one commit would fail.
        self._ledger_lock = threading.Lock()
        self._spend_expectation: SpendExpectation | None = None
        # The expectation the watchdog last woke the tick for: until a tick replaces it, another
        # reason would only queue a second tick behind the one already asked for.
        self._woken_for: SpendExpectation | None = None
        self.budget_wakes = 0
        # Seconds the last finished tick took (solve and push): the watchdog's latency allowance.
        self.last_tick_s = 0.0
        # When this replica became leader: heartbeats are judged only after a full timeout,
        # so a scheduler restart does not declare every node lost.
        self.leader_since: datetime | None = None

    def wake(self) -> None:
        """Ask for a tick as soon as possible (thread-safe: API handlers run in worker threads)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.wake_event.set)

    async def run(self) -> None:
        """Tick every slot, or sooner when woken, until stopped."""
        self._loop = asyncio.get_running_loop()
        with transaction(self.session_factory) as session:
            if anchor_replay(session, self.carbon):
                log.info("carbon replay resumed where the previous scheduler left it")
        sampler = asyncio.create_task(self._sample_carbon(), name="greenflow-carbon-sampler")
        try:
            await self._tick_forever()
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler

    async def _sample_carbon(self) -> None:
        """Record the intensity now, several times a slot, so the ledger charges what was real."""
        interval_s = self.config.planner.budget_check_s()
        while not self._stopping:
            await asyncio.sleep(interval_s)
            if self.leader_since is None:
                continue
            try:
                await self.sample_carbon_once(interval_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("recording the carbon intensity failed")

    async def sample_carbon_once(self, interval_s: float) -> str | None:
        """Record the intensity now and run the budget watchdog; wake the tick if it says why."""
        forecast = await self.carbon.get_forecast(int(max(interval_s, 60)))
        reason = await asyncio.to_thread(self._record_now, forecast)
        if reason is not None:
            log.warning("budget watchdog: %s; planning again now", reason)
            self.budget_wakes += 1
            self.wake()
        return reason

    def watch_lead_s(self) -> float:
        """Seconds the watchdog looks ahead: to a stop decided at the next check taking effect."""
        planner = self.config.planner
        return watch_lead_s(
            planner.budget_check_s(),
            self.config.cluster.agent_telemetry_interval_s,
            max(self.last_tick_s, planner.tick_latency_floor_s),
        )

    def _record_now(self, forecast: CarbonForecast) -> str | None:
        with self._ledger_lock, transaction(self.session_factory) as session:
            record_intensity_now(session, forecast)
            if self.config.budget.enforcement != "hard":
                return None
            charged = charge_new_telemetry(session, self.config)
            if not charged.samples:
                return None
            now = utcnow()
            expectation = self._spend_expectation
            reason = replan_reason(
                current_period(session, self.config, now),
                expectation,
                now,
                rate_kg_per_s=charged.rate_kg_per_s,
                lead_s=self.watch_lead_s(),
            )
            if reason is None or (expectation is not None and expectation is self._woken_for):
                return None
            self._woken_for = expectation
            return reason

    async def _tick_forever(self) -> None:
        while not self._stopping:
            # A fresh AsyncRetrying each slot: the backoff starts over after a tick that worked.
            async for attempt in self._tick_retrying():
                with attempt:
                    await self._tick_if_leader()
            await self._sleep_or_wake(self.config.planner.slot_s)

    def _tick_retrying(self) -> AsyncRetrying:
        planner = self.config.planner
        return AsyncRetrying(
            # Cancellation is no Exception: it ends the loop instead of being retried.
            retry=retry_if_exception_type(Exception),
            wait=wait_exponential(multiplier=planner.tick_retry_initial_s, max=planner.slot_s),
            # A wake (a job submitted, the budget watchdog) cuts the backoff short; so does stop().
            sleep=self._sleep_or_wake,
            before_sleep=self._tick_failed,
        )

    async def _tick_if_leader(self) -> None:
        conflicts = 0
        while not self._stopping:
            # Cleared before the tick, not after: a wake that arrives while a tick runs (a job
            # submitted, the budget watchdog) must start the next tick, not wait a whole slot.
            self.wake_event.clear()
            try:
                if await asyncio.to_thread(self.leader.try_acquire):
                    if self.leader_since is None:
                        self.leader_since = utcnow()
                    await self.tick()
                else:
                    self.leader_since = None
                return
            except StaleDataError:
                # A job changed (telemetry, a cancel) while we planned: plan again at once, a few
                # times; then fail the tick (re-raise) so the backoff spaces the next attempts.
                conflicts += 1
                self.stale_replans += 1
                if conflicts > STALE_REPLANS_AT_ONCE:
                    log.warning(
                        "a job changed during %d plans in a row; backing off before planning again",
                        conflicts,
                    )
                    raise
                log.info("a job changed during the tick; planning again")

    def _tick_failed(self, state: RetryCallState) -> None:
        # Re-arm the watchdog: else a woken tick that failed before re-planning would keep it
        # quiet about the plan still in force while the budget runs on. No lock: a check racing
        # this only wakes the tick one check later.
        self._woken_for = None
        self.tick_failures += 1
        error = state.outcome.exception() if state.outcome is not None else None
        log.error(
            "control-loop tick failed (%d in a row); retrying in %.1f s, or at once when woken",
            state.attempt_number,
            state.upcoming_sleep,
            exc_info=error,
        )

    async def _sleep_or_wake(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake_event.wait(), timeout=timeout_s)

    async def stop(self) -> None:
        """Stop ticking and release the lock and connections."""
        self._stopping = True
        self.wake_event.set()
        await self.agents.aclose()
        await self.carbon.aclose()
        self.leader.release()

    async def tick(self) -> TickReport:
        """One pass of DESIGN.md's data flow."""
        started_s = time.monotonic()
        now = utcnow()
        forecast = await self.carbon.get_forecast(self.config.planner.horizon_s)
        planned, plan = await asyncio.to_thread(self._plan, forecast, now)
        deliveries = await asyncio.to_thread(self._deliveries)
        acked = failed = 0
        # Stops and shrinks first (they free slots), then the rest; within a group, in parallel:
        # starting a job's workers takes seconds and must not hold up the others.
        for order in sorted({d.order for d in deliveries}):
            results = await asyncio.gather(
                *(self._deliver(d) for d in deliveries if d.order == order)
            )
            acked += sum(results)
            failed += len(results) - sum(results)
        self.last_tick_s = time.monotonic() - started_s
        report = TickReport(
            now,
            planned,
            len(deliveries),
            acked,
            failed,
            forecast.degraded,
            plan.status if plan is not None else None,
            plan.gap if plan is not None else None,
            plan.solve_s if plan is not None else None,
            finished_at=utcnow(),
        )
        # One assignment: a scrape (another thread) sees this tick's report whole or not at all.
        self.last_report = report
        self.ticks += 1
        return report

    def _plan(self, forecast: CarbonForecast, now: datetime) -> tuple[int, AllocationPlan | None]:
        with self._ledger_lock, transaction(self.session_factory) as session:
            record_forecast(session, forecast)
            timeout_s = self.config.cluster.heartbeat_timeout_s
            if self.leader_since is None or (now - self.leader_since).total_seconds() >= timeout_s:
                mark_lost_nodes(session, timeout_s=timeout_s, now=now)
            charge_new_telemetry(session, self.config)
            dispatch.enforce_deadlines(session, now)
            dispatch.stop_finished_jobs(session)
            planning = build_problem(session, self.config, forecast, self.models, now)
            jobs = JobRepository(session)
            for job_id, reason in planning.unplaceable.items():
                job = jobs.get(job_id)
                if job is not None and job.state_reason != reason:
                    job.state_reason = reason
            plan: AllocationPlan | None = None
            if not planning.problem.jobs:
                # Nothing planned, nothing expected: the watchdog's once-per-plan rules then
                # hold for this empty plan too, instead of waking a tick at every check.
                expectation = SpendExpectation.of_nothing(
                    now, self.config.planner.slot_s, current_period(session, self.config, now)
                )
            else:
                plan = self.policy(
                    planning.problem,
                    previous=self.previous,
                    time_limit_s=self.config.planner.solver_time_limit_s,
                    seed=self.config.planner.seed,
                )
                expectation = SpendExpectation.of_plan(
                    plan, current_period(session, self.config, now)
                )
                repo = AllocationRepository(session)
                repo.add_plan(plan_row(plan, planning.problem, forecast.degraded))
                repo.prune_plans(PLANS_KEPT)
                changed = dispatch.decide(session, planning, plan, now)
                if changed:
                    log.info("plan %s: %d allocation change(s)", plan.status, changed)
        # Only once the transaction committed: a tick whose commit fails (a job changed while it
        # planned) leaves the plan in force, and the watchdog's expectation of it, as they were.
        self._spend_expectation = expectation
        if plan is not None:
            self.previous = plan
        return len(planning.problem.jobs), plan

    def _deliveries(self) -> list[dispatch.Delivery]:
        with transaction(self.session_factory) as session:
            return dispatch.deliveries(session)

    async def _deliver(self, delivery: dispatch.Delivery) -> bool:
        command = delivery.command
        try:
            if isinstance(command, dispatch.StopCommand):
                await self.agents.stop(delivery.agent_url, delivery.secret, command)
                ack = None
            else:
                ack = await self.agents.apply(delivery.agent_url, delivery.secret, command)
        except AgentRejected as exc:
            log.warning(
                "agent refused job %s generation %s: %s", command.job_id, command.generation, exc
            )
            await asyncio.to_thread(self._record_failure, delivery.allocation_id, str(exc), True)
            return False
        except AgentUnreachable as exc:
            log.warning("agent unreachable for job %s: %s", command.job_id, exc)
            await asyncio.to_thread(self._record_failure, delivery.allocation_id, str(exc), False)
            return False
        if ack is not None:
            what = "hot switch" if ack.hot_switch else "allocation"
            log.info(
                "job %s: %s -> %d GPUs (%s) at step %d",
                ack.job_id,
                what,
                ack.gpus,
                ack.layout,
                ack.step,
            )
        await asyncio.to_thread(self._record_ack, delivery.allocation_id, ack)
        return True

    def _record_ack(self, allocation_id: int, ack: dispatch.AllocationAck | None) -> None:
        run_in_transaction(
            self.session_factory, lambda s: dispatch.record_ack(s, allocation_id, ack)
        )

    def _record_failure(self, allocation_id: int, error: str, rejected: bool) -> None:
        run_in_transaction(
            self.session_factory,
            lambda s: dispatch.record_failure(s, allocation_id, error, rejected=rejected),
        )
