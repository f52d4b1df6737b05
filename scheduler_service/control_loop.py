"""The control loop: every slot (and at once on events) forecast -> fit -> solve -> place -> push."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from energy_model.carbon.forecast import CarbonForecast
from energy_model.carbon.resilient import ResilientCarbonSource
from scheduler_service.allocation.policies import get_policy
from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem
from scheduler_service.budget.enforcement import (
    pause_jobs_over_team_budget,
    team_budget_wake_reason,
)
from scheduler_service.budget.ledger import charge_new_telemetry, current_period
from scheduler_service.budget.periods import PeriodStatus
from scheduler_service.budget.watchdog import SpendExpectation, replan_reason, watch_lead_s
from scheduler_service.bundles.service import sweep_bundles
from scheduler_service.carbon.service import (
    anchor_replay,
    make_carbon_source,
    record_forecast,
    record_intensity_now,
    seed_history,
)
from scheduler_service.db.base import utcnow
from scheduler_service.db.session import run_in_transaction, transaction
from scheduler_service.deadline_risk import record_deadline_risks
from scheduler_service.dispatch import service as dispatch
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.leader import LeaderLock
from scheduler_service.nodes.agent_client import AgentClient, AgentRejected, AgentUnreachable
from scheduler_service.nodes.secrets import NodeSecrets
from scheduler_service.nodes.service import mark_lost_nodes
from scheduler_service.planning import (
    JobModels,
    PlanningInput,
    SnapshotRows,
    assemble_snapshot,
    plan_row,
    read_rows,
    span_fresh_s,
)
from scheduler_service.settings import GreenflowConfig
from scheduler_service.solver_process import SolverProcess

log = logging.getLogger("greenflow.loop")

PLANS_KEPT = 500
# How often the leader sweeps workdir bundles past their retention ([workloads] bundle_retention_h).
BUNDLE_SWEEP_S = 3600.0
# Conflicts in a row (a job changed while the tick planned) that are planned again at once; the
# next one fails the tick, so a job that changes continuously meets the backoff, not a spin.
STALE_REPLANS_AT_ONCE = 3
# Commands sent at once (and the agent client's connections).
DELIVERIES_IN_FLIGHT = 100


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
    # CPU seconds of the solve (its wall time is phases_s["solve"]); None: nothing solved.
    solve_cpu_s: float | None = None
    finished_at: datetime | None = None
    # Seconds per phase: refits (waiting for the last tick's refits, which ran beside its
    # solve), snapshot (transaction one), models (the problem), solve (no transaction), write
    # (transaction two), dispatch (read the commands, push them, record the acknowledgements).
    phases_s: dict[str, float] = field(default_factory=dict)
    # CPU seconds of the tick's own thread in the snapshot, models and write phases: the rest of
    # each phase's wall time it waited (the database, the GIL shared with the API's requests,
    # a CPU busy with other processes).
    phases_cpu_s: dict[str, float] = field(default_factory=dict)


def load_planning_libraries() -> None:
    """Import what the first solve and the first model refit would (OR-Tools with pandas, scipy's
    optimiser), so that `greenflow serve` starts without them and no tick waits for them."""
    for module in ("ortools.linear_solver.python.model_builder", "scipy.optimize"):
        importlib.import_module(module)


class ControlLoop:
    """Runs ticks while this replica holds the leader lock."""

    def __init__(
        self,
        config: GreenflowConfig,
        session_factory: sessionmaker[Session],
        engine: Engine,
        policy: str | None = None,
        carbon: ResilientCarbonSource | None = None,
        node_secrets: NodeSecrets | None = None,
        solver_process: bool = False,
    ) -> None:
        """`solver_process`: solve in a worker process (`greenflow serve` does, by
        `[planner] solver_process`); else in the tick's thread."""
        self.config = config
        # The app passes the scheduler key; a loop built alone (tests) draws its own.
        self.node_secrets = node_secrets or NodeSecrets.generate()
        self.session_factory = session_factory
        self.carbon = carbon or make_carbon_source(config.carbon)
        self.policy_name = policy or config.planner.policy
        self.policy = get_policy(self.policy_name)
        # A solve of seconds in a thread of this process shares the GIL with the API: the two
        # slowed each other (1,000 jobs: a 5 s limit took 8.5 s, API p99 0.3 s).
        self.solver = SolverProcess(self.policy_name) if solver_process else None
        # Refits run in their own thread beside the solve (deferred): a tick plans with each
        # job's model as it stood (a just-started job's shared prior) and the next tick with
        # the refits; they are finished before the next snapshot reads telemetry into them.
        self.models = JobModels(
            refit_interval_s=config.planner.model_refit_interval_s,
            max_refits=config.planner.model_refits_per_tick,
            deferred=True,
        )
        self._refit_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="greenflow-refit")
        self._refitting: Future[float] | None = None
        self.previous: AllocationPlan | None = None
        self.agents = AgentClient(max_connections=DELIVERIES_IN_FLIGHT)
        self._sends = asyncio.Semaphore(DELIVERIES_IN_FLIGHT)
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
        self._last_tick_started_s = -float("inf")
        # When this replica became leader: heartbeats are judged only after a full timeout,
        # so a scheduler restart does not declare every node lost.
        self.leader_since: datetime | None = None
        self._bundles_swept_s = -float("inf")

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
            seed_history(session, self.carbon, utcnow())
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
            teams = any(t.enforcement == "hard" for t in self.config.budget.teams.values())
            if self.config.budget.enforcement != "hard" and not teams:
                return None
            charged = charge_new_telemetry(session, self.config)
            if not charged.samples:
                return None
            now = utcnow()
            # A team's hard budget just spent: the tick pauses its jobs (once; then it is quiet).
            team_reason = team_budget_wake_reason(session, self.config, now) if teams else None
            if team_reason is not None or self.config.budget.enforcement != "hard":
                return team_reason
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
        warm_up: asyncio.Task[None] | None = None
        while not self._stopping:
            # A fresh AsyncRetrying each slot: the backoff starts over after a tick that worked.
            async for attempt in self._tick_retrying():
                with attempt:
                    await self._tick_if_leader()
            if warm_up is None and self.leader_since is not None:
                # Once leader, after a first tick: the libraries a solve and a model refit load
                # (seconds) are loaded now, between ticks, not inside the first tick needing them.
                warm_up = asyncio.create_task(asyncio.to_thread(self._load_libraries))
            await self._sleep_or_wake(self.config.planner.slot_s)
            await self._coalesce_wakes()

    def _load_libraries(self) -> None:
        load_planning_libraries()
        if self.solver is not None:
            self.solver.warm_up()

    async def _coalesce_wakes(self) -> None:
        """Hold a woken tick until `wake_coalesce_s` after the last tick's start: the wakes that
        arrive meanwhile (a burst of submissions) are served by that one tick."""
        until_s = self._last_tick_started_s + self.config.planner.wake_coalesce_s
        while not self._stopping and (rest_s := until_s - time.monotonic()) > 0:
            await asyncio.sleep(min(rest_s, 0.1))

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
            self._last_tick_started_s = time.monotonic()
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
        if self.solver is not None:
            self.solver.close()
        # A refit in progress ends on its own (at most a tick's worth); none is started after.
        self._refit_pool.shutdown(wait=False, cancel_futures=True)
        self.leader.release()

    async def tick(self) -> TickReport:
        """One pass of DESIGN.md's data flow."""
        started_s = time.monotonic()
        now = utcnow()
        forecast = await self.carbon.get_forecast(self.config.planner.horizon_s)
        phases_s: dict[str, float] = {}
        phases_cpu_s: dict[str, float] = {}
        planned, plan = await asyncio.to_thread(self._plan, forecast, now, phases_s, phases_cpu_s)
        # CPU seconds, not a phase of the tick's wall time: reported on their own.
        solve_cpu_s = phases_s.pop("solve_cpu", None)
        dispatch_began_s = time.monotonic()
        deliveries = await asyncio.to_thread(self._deliveries)
        acked = failed = 0
        # Stops and shrinks first (they free slots), then the rest; within a group, in parallel:
        # starting a job's workers takes seconds and must not hold up the others.
        for order in sorted({d.order for d in deliveries}):
            outcomes = await self._deliver_group([d for d in deliveries if d.order == order])
            acked += sum(1 for o in outcomes if o.ok)
            failed += sum(1 for o in outcomes if not o.ok)
        moved = {d.command.job_id for d in deliveries if d.blocks}
        if moved:
            # Commands that waited behind one of this round (a move's start on its new node,
            # behind the pause on the old one): delivered now that those are answered, not a
            # whole slot later at the next tick.
            after = [
                d for d in await asyncio.to_thread(self._deliveries) if d.command.job_id in moved
            ]
            for order in sorted({d.order for d in after}):
                outcomes = await self._deliver_group([d for d in after if d.order == order])
                acked += sum(1 for o in outcomes if o.ok)
                failed += sum(1 for o in outcomes if not o.ok)
            deliveries += after
        phases_s["dispatch"] = time.monotonic() - dispatch_began_s
        await asyncio.to_thread(self._sweep_bundles_if_due, now)
        self.last_tick_s = time.monotonic() - started_s
        log.info(
            "tick: %d job(s), %d command(s) in %.3f s (%s)",
            planned,
            len(deliveries),
            self.last_tick_s,
            ", ".join(f"{name} {seconds:.3f} s" for name, seconds in phases_s.items()),
        )
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
            phases_s=phases_s,
            solve_cpu_s=solve_cpu_s,
            phases_cpu_s=phases_cpu_s,
        )
        # One assignment: a scrape (another thread) sees this tick's report whole or not at all.
        self.last_report = report
        self.ticks += 1
        return report

    def _sweep_bundles_if_due(self, now: datetime) -> None:
        """Remove workdir bundles past their retention, at most once per BUNDLE_SWEEP_S; a
        failure is logged and left to the next sweep (the tick's work is done)."""
        if time.monotonic() - self._bundles_swept_s < BUNDLE_SWEEP_S:
            return
        self._bundles_swept_s = time.monotonic()
        retention = timedelta(hours=self.config.workloads.bundle_retention_h)
        try:
            with transaction(self.session_factory) as session:
                report = sweep_bundles(session, now, retention)
        except Exception:
            log.exception("the bundle retention sweep failed")
            return
        if report.removed:
            log.info(
                "bundle retention: removed %d bundle(s) unused for %s, %d bytes freed",
                len(report.removed),
                retention,
                report.freed_bytes,
            )

    def _plan(
        self,
        forecast: CarbonForecast,
        now: datetime,
        phases_s: dict[str, float] | None = None,
        phases_cpu_s: dict[str, float] | None = None,
    ) -> tuple[int, AllocationPlan | None]:
        # Three steps (DESIGN.md, one tick): read the snapshot in one transaction, solve with no
        # transaction or lock held, write the plan and its commands in a second transaction. A
        # job changed in between fails the second one's flush (its version column), and the
        # loop plans again from a new snapshot.
        phases_s = {} if phases_s is None else phases_s
        phases_cpu_s = {} if phases_cpu_s is None else phases_cpu_s
        # The last tick's refits end before this snapshot reads new telemetry into the models
        # (nearly always long done: they ran beside that tick's solve).
        began_s = time.monotonic()
        refit_cpu_s = self._finish_refits()
        phases_s["refits"] = time.monotonic() - began_s
        if refit_cpu_s is not None:
            phases_cpu_s["refits"] = refit_cpu_s
        began_s, began_cpu_s = time.monotonic(), time.thread_time()
        rows, period = self._read_snapshot(forecast, now)
        phases_s["snapshot"] = time.monotonic() - began_s
        phases_cpu_s["snapshot"] = time.thread_time() - began_cpu_s
        began_s, began_cpu_s = time.monotonic(), time.thread_time()
        # The problem, after the transaction: CPU work holds no lock. The refits it leaves due
        # start now, beside the solve (the solver's worker process, or the GIL between them).
        planning = assemble_snapshot(rows, self.config, forecast, self.models)
        if self.models.due:
            self._refitting = self._refit_pool.submit(self._run_refits)
        phases_s["models"] = time.monotonic() - began_s
        phases_cpu_s["models"] = time.thread_time() - began_cpu_s
        began_s = time.monotonic()
        plan: AllocationPlan | None = None
        if planning.problem.jobs:
            # The solve's CPU seconds ride in phases_s to the tick, which reports them apart.
            plan, phases_s["solve_cpu"] = self._solve(planning.problem)
            expectation = SpendExpectation.of_plan(plan, period)
        else:
            # Nothing planned, nothing expected: the watchdog's once-per-plan rules then
            # hold for this empty plan too, instead of waking a tick at every check.
            expectation = SpendExpectation.of_nothing(now, self.config.planner.slot_s, period)
        phases_s["solve"] = time.monotonic() - began_s
        began_s, began_cpu_s = time.monotonic(), time.thread_time()
        with transaction(self.session_factory) as session:
            self._write_plan(session, planning, plan, forecast.degraded, now)
        phases_s["write"] = time.monotonic() - began_s
        phases_cpu_s["write"] = time.thread_time() - began_cpu_s
        # Only once the transaction committed: a tick whose commit fails (a job changed while it
        # planned) leaves the plan in force, and the watchdog's expectation of it, as they were.
        self._spend_expectation = expectation
        if plan is not None:
            self.previous = plan
        return len(planning.problem.jobs), plan

    def _run_refits(self) -> float:
        """In the refit thread: the refits the last snapshot left due; their CPU seconds."""
        began_s = time.thread_time()
        self.models.refit_due()
        return time.thread_time() - began_s

    def _finish_refits(self) -> float | None:
        """Wait for the refits started by the last tick; their CPU seconds (None: none ran). A
        refit that failed is logged, and its job keeps the model it had."""
        refitting, self._refitting = self._refitting, None
        if refitting is None:
            return None
        try:
            return refitting.result()
        except Exception:
            log.exception("refitting the job models failed; the jobs keep their models")
            return None

    def _solve(self, problem: AllocationProblem) -> tuple[AllocationPlan, float]:
        """The policy's plan, and the CPU seconds of the solve (by the worker's clock, or this
        thread's)."""
        planner = self.config.planner
        if self.solver is not None:
            return self.solver.solve(problem, self.previous, planner.solve_limit_s(), planner.seed)
        began_s = time.thread_time()
        plan = self.policy(
            problem,
            previous=self.previous,
            time_limit_s=planner.solve_limit_s(),
            seed=planner.seed,
        )
        return plan, time.thread_time() - began_s

    def _read_snapshot(
        self, forecast: CarbonForecast, now: datetime
    ) -> tuple[SnapshotRows, PeriodStatus]:
        """Transaction one: the tick's own bookkeeping, then the snapshot to plan on."""
        with self._ledger_lock, transaction(self.session_factory) as session:
            record_forecast(session, forecast)
            timeout_s = self.config.cluster.heartbeat_timeout_s
            if self.leader_since is None or (now - self.leader_since).total_seconds() >= timeout_s:
                mark_lost_nodes(session, timeout_s=timeout_s, now=now)
            charge_new_telemetry(session, self.config)
            dispatch.enforce_deadlines(session, now)
            dispatch.stop_finished_jobs(session)
            pause_jobs_over_team_budget(session, self.config, now)
            rows = read_rows(session, self.config, self.models, now)
            return rows, current_period(session, self.config, now)

    def _write_plan(
        self,
        session: Session,
        planning: PlanningInput,
        plan: AllocationPlan | None,
        degraded: bool,
        now: datetime,
    ) -> None:
        """Transaction two: why unplaceable jobs wait, the Plan row and the commands."""
        # Plain rows: decide locks only the jobs it writes.
        rows = dispatch.planned_plain_rows(session, planning)
        if planning.unplaceable:
            # With no node up every queued job is here: read their reasons (plain rows) and load
            # and write only the jobs whose reason changes (at most the newly queued ones).
            jobs = JobRepository(session)
            stored = jobs.state_reasons(list(planning.unplaceable))
            changing = [j for j, reason in planning.unplaceable.items() if stored.get(j) != reason]
            for job_id, job in jobs.get_many(changing).items():
                job.state_reason = planning.unplaceable[job_id]
        if plan is None:
            return
        repo = AllocationRepository(session)
        repo.add_plan(plan_row(plan, planning.problem, degraded), plan.gpus, plan.missed_reasons)
        repo.prune_plans(PLANS_KEPT)
        changed = dispatch.decide(
            session,
            planning,
            plan,
            now,
            rows,
            # A spanning job is not placed across a node silent for three heartbeats.
            span_fresh_s=span_fresh_s(self.config),
            move_running=self.config.cluster.checkpoints_shared,
        )
        record_deadline_risks(session, planning.problem, plan, rows, now)
        if changed:
            log.info("plan %s: %d allocation change(s)", plan.status, changed)

    def _deliveries(self) -> list[dispatch.Delivery]:
        with transaction(self.session_factory) as session:
            return dispatch.deliveries(session, self.node_secrets)

    async def _deliver(self, delivery: dispatch.Delivery) -> _Outcome:
        """Send one command; what came of it (recorded by the caller, a group at a time)."""
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
            return _Outcome(delivery.allocation_id, None, str(exc), rejected=True)
        except AgentUnreachable as exc:
            log.warning("agent unreachable for job %s: %s", command.job_id, exc)
            return _Outcome(delivery.allocation_id, None, str(exc), rejected=False)
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
        return _Outcome(delivery.allocation_id, ack, None)

    async def _deliver_in_turn(self, delivery: dispatch.Delivery) -> _Outcome:
        # At most as many sends as the client has connections: one queued for a connection
        # would spend its timeout waiting (2,000 commands at once went "unreachable" that way).
        async with self._sends:
            return await self._deliver(delivery)

    async def _deliver_group(self, group: list[dispatch.Delivery]) -> list[_Outcome]:
        """Send a group in parallel; record what came back as it comes, the answers that
        arrived together in one transaction (a plan that moves a thousand jobs is not a
        thousand transactions), so an acknowledgement is in the database soon after it arrives."""
        pending = {asyncio.create_task(self._deliver_in_turn(d)) for d in group}
        outcomes: list[_Outcome] = []
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                batch = [task.result() for task in done]
                await asyncio.to_thread(self._record, batch)
                outcomes += batch
        finally:
            # A tick that ends early (stopped, or a recording failed) leaves no send behind.
            for task in pending:
                task.cancel()
        return outcomes

    def _record(self, outcomes: list[_Outcome]) -> None:
        """Record a group's outcomes in one transaction; one by one if a job changed meanwhile
        (each then retried on its own, so one busy job does not hold back the others)."""
        try:
            with transaction(self.session_factory) as session:
                _read = dispatch.prefetch_answers(session, [o.allocation_id for o in outcomes])
                # In one order (telemetry locks jobs too): fewer deadlocks between the two.
                for outcome in sorted(outcomes, key=lambda o: o.allocation_id):
                    outcome.record(session)
        except (StaleDataError, DBAPIError) as exc:
            # A job changed meanwhile, or PostgreSQL broke a deadlock with a telemetry write.
            log.info("recording %d answers together failed (%s); one by one", len(outcomes), exc)
            for outcome in outcomes:
                run_in_transaction(self.session_factory, outcome.record)


@dataclass(frozen=True)
class _Outcome:
    """What came of one delivery: an acknowledgement (None for a stop), or the error."""

    allocation_id: int
    ack: dispatch.AllocationAck | None
    error: str | None
    rejected: bool = False

    @property
    def ok(self) -> bool:
        """The agent took the command."""
        return self.error is None

    def record(self, session: Session) -> None:
        """Write it down (the acknowledgement's state change, or the failure)."""
        if self.error is None:
            dispatch.record_ack(session, self.allocation_id, self.ack)
        else:
            dispatch.record_failure(session, self.allocation_id, self.error, rejected=self.rejected)
