"""Admission: incremental against the plan in force, one check at a time, no query per job."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

import scheduler_service.admission as admission_module
from energy_model.job_model import JobModelFitter, prior_job_model
from scheduler_service.admission import Admission, BorrowedModels
from scheduler_service.allocation.admission import (
    HeldGpus,
    admit,
    admit_on_spare,
    team_budget_refusal,
)
from scheduler_service.allocation.problem import (
    AllocationProblem,
    BudgetMode,
    BudgetPeriod,
    JobSpec,
    TeamBudget,
)
from scheduler_service.auth.service import Principal, Role
from scheduler_service.control_loop import ControlLoop
from scheduler_service.db import migrate
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import GpuSlot, Job, Node, Plan
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.exceptions import FieldError
from scheduler_service.jobs import service
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.schemas import JobSpec as JobRequest
from scheduler_service.jobs.states import JobState
from scheduler_service.planning import JobModels
from scheduler_service.settings import GreenflowConfig
from tests.api.conftest import (  # noqa: F401
    database_url,
    fresh_postgres_database,
    postgres_server,
)
from tests.service.test_snapshot import _count_selects
from tests.support.rows import add_node

T0 = datetime(2026, 6, 1, 12, tzinfo=UTC)
SLOT_S = 600.0


def _spec(job_id: str, deadline_s: float | None, samples: float = 6_000.0) -> JobSpec:
    # 10 samples/s on one GPU, 18 on two.
    return JobSpec(
        job_id=job_id,
        allowed_gpus=(1, 2),
        throughput_samples_per_s=(10.0, 18.0),
        power_w=(300.0, 600.0),
        remaining_samples=samples,
        deadline_s=deadline_s,
    )


def _problem(*jobs: JobSpec, **fields: Any) -> AllocationProblem:
    base: dict[str, Any] = {
        "start_at": T0,
        "slot_s": SLOT_S,
        "capacity_gpus": (4,) * 6,
        "intensity_g_per_kwh": (100.0,) * 6,
        "jobs": jobs,
    }
    return AllocationProblem(**(base | fields))


def test_a_deadline_is_admitted_on_what_the_plan_leaves_without_moving_other_jobs() -> None:
    # The plan holds 3 of 4 GPUs for two slots: "a" (1 GPU) and "b" (2 GPUs), both with a
    # deadline, and the last one for "c", which has none (so it yields to a new deadline).
    plan = HeldGpus(
        T0,
        SLOT_S,
        {"a": (1, 1, 0, 0, 0, 0), "b": (2, 2, 2, 0, 0, 0), "c": (1, 1, 1, 1, 1, 1)},
    )
    a, b, c = _spec("a", 1_300.0, 12_000.0), _spec("b", 3_000.0, 30_000.0), _spec("c", None)
    # 15,000 samples by 1,800 s: one GPU for two slots (6,000 each), then two (10,800).
    new = _spec("new", 1_800.0, 15_000.0)
    fast = admit_on_spare(_problem(a, b, c), new, plan)
    assert fast is not None
    decision, held = fast
    assert decision.admitted and decision.guaranteed
    assert held.start_at == T0 and held.gpus["new"][:3] == (1, 1, 2)
    # Too much work for what is left before the deadline: only a full solve can tell.
    assert admit_on_spare(_problem(a, b, c), _spec("new", 1_800.0, 30_000.0), plan) is None
    # A promise made since the plan (its job not listed yet) counts like the plan.
    taken = HeldGpus(T0, SLOT_S, {"e": (1, 1, 1, 1, 1, 1)})
    assert admit_on_spare(_problem(a, b, c), new, plan, (taken,)) is None
    # A deadline job the plan does not hold: its promise is unknown here.
    assert admit_on_spare(_problem(a, b, c, _spec("d", 3_000.0)), new, plan) is None
    # The plan's next slot boundary came and went: its rows move with the clock.
    later = _problem(a, b, c, start_at=T0 + timedelta(seconds=2 * SLOT_S))
    shifted = admit_on_spare(later, _spec("new", 1_200.0, 6_000.0), plan)
    assert shifted is not None and shifted[1].gpus["new"][0] == 2
    # A hard budget the plan already spends: the new job's kg must fit what is left.
    spent = BudgetPeriod(0.0, 6 * SLOT_S, budget_left_kg=0.0)
    hard = _problem(a, b, c, budget_periods=(spent,), budget_mode=BudgetMode.HARD)
    assert admit_on_spare(hard, new, plan) is None


def test_held_rows_take_the_most_of_the_slots_each_problem_slot_overlaps() -> None:
    held = HeldGpus(T0, SLOT_S, {"x": (1, 3, 2), "y": (), "z": (4,)})
    # Half a slot later: each problem slot overlaps two held ones; past the row, its last count.
    half = _problem(start_at=T0 + timedelta(seconds=SLOT_S / 2))
    assert held.over(half, "x") == (3, 3, 2, 2, 2, 2)
    assert held.rows(half, ["y", "z", "x"]).tolist() == [[0] * 6, [4] * 6, [3, 3, 2, 2, 2, 2]]
    # On the grid: slot for slot.
    assert held.over(_problem(), "x") == (1, 3, 2, 2, 2, 2)
    assert held.over(_problem(), "absent") is None


def test_a_deadline_is_held_to_its_teams_hard_budget() -> None:
    # 100 g/kWh: one GPU (300 W) for one 600 s slot emits 5 g. "a", a deadline job of team nlp,
    # holds one GPU for two slots (10 g); "c" (no deadline) yields. The new job of nlp needs
    # 15,000 samples by 1,800 s: at least 12.5 g (1 GPU), 13.9 g at the 2 GPUs it gets here.
    plan = HeldGpus(T0, SLOT_S, {"a": (1, 1, 0, 0, 0, 0), "c": (1, 1, 1, 1, 1, 1)})
    a, c = _spec("a", 1_300.0, 12_000.0), _spec("c", None)
    new = _spec("new", 1_800.0, 15_000.0)

    def nlp_left(g: float, *jobs: JobSpec) -> AllocationProblem:
        team = TeamBudget(
            team="nlp",
            job_ids=frozenset({"a", "c"}),
            periods=(BudgetPeriod(0.0, 6 * SLOT_S, budget_left_kg=g / 1000),),
        )
        # The cluster's own budget is soft: only the team's binds.
        return _problem(*jobs, team_budgets=(team,), budget_mode=BudgetMode.SOFT)

    # Not even the whole 10 g pays for it: the check cannot promise it, and the refusal names
    # the budget.
    assert admit_on_spare(nlp_left(10.0, a, c), new, plan, team="nlp") is None
    short = team_budget_refusal(nlp_left(10.0, a, c), new, "nlp")
    assert short is not None and "team 'nlp' hard carbon budget has 10 g CO2e left" in short
    assert team_budget_refusal(nlp_left(20.0, a, c), new, "nlp") is None
    # 20 g: alone it could be paid for, but "a" keeps 10 g of it: only a full solve can tell.
    assert admit_on_spare(nlp_left(20.0, a, c), new, plan, team="nlp") is None
    # 40 g: promised, and the promise carries its team (later checks count it against nlp).
    fast = admit_on_spare(nlp_left(40.0, a, c), new, plan, team="nlp")
    assert fast is not None and fast[0].guaranteed
    assert fast[1].teams == {"new": "nlp"}
    # The same job of another team (or none) does not draw on nlp's budget.
    assert admit_on_spare(nlp_left(10.0, a, c), new, plan) is not None
    assert admit_on_spare(nlp_left(10.0, a, c), new, plan, team="vision") is not None
    # A promise of nlp still committing (its job not listed) spends nlp's budget too: 30 g.
    watts = {0: 0.0, 1: 300.0}
    for team, outcome in (("nlp", False), ("vision", True)):
        e = HeldGpus(T0, SLOT_S, {"e": (1,) * 6}, {"e": watts}, {"e": team})
        checked = admit_on_spare(nlp_left(40.0, a, c), new, plan, (e,), team="nlp")
        assert (checked is not None) is outcome, team


def test_a_full_solve_names_the_team_budget_that_cuts_the_new_job() -> None:
    # Alone the job could be paid for by 14 g, but team nlp's other deadline job spends 10 g of
    # it: the plan cuts the new one, and the reason says so.
    a = _spec("a", 1_200.0, 12_000.0)
    team = TeamBudget(
        team="nlp",
        job_ids=frozenset({"a"}),
        periods=(BudgetPeriod(0.0, 6 * SLOT_S, budget_left_kg=0.024),),
    )
    problem = _problem(a, team_budgets=(team,), budget_mode=BudgetMode.SOFT)
    decision = admit(problem, _spec("new", 1_800.0, 15_000.0), team="nlp", time_limit_s=1.0)
    assert not decision.admitted
    assert "team 'nlp' hard carbon budget" in decision.reason
    # Without the team (another queue) the same job is promised.
    assert admit(problem, _spec("new", 1_800.0, 15_000.0), time_limit_s=1.0).guaranteed


def test_admission_borrows_the_loops_fitted_models_without_reading_or_refitting() -> None:
    one_two, one_to_four = (1, 2), (1, 2, 4)
    loop = JobModels()
    loop.fitters[1] = JobModelFitter(prior_job_model("resnet50", 256, one_two))
    fitted = replace(loop.fitters[1].model, power_w={1: 111.0, 2: 222.0})
    loop.fitters[1].model = fitted
    loop.fitters[2] = JobModelFitter(prior_job_model("resnet50", 256, one_to_four))
    borrowed = BorrowedModels(loop_models=loop)
    priors = {
        1: prior_job_model("resnet50", 256, one_two),
        2: prior_job_model("resnet50", 256, one_two),  # the loop knows it at other counts
        3: prior_job_model("resnet50", 256, one_two),  # the loop does not know it yet
    }
    # No session: nothing is read.
    borrowed.refresh(cast(Session, None), priors)
    models = borrowed.fitted([1, 2, 3])
    assert models[1] is fitted
    assert models[2] is borrowed.fitters[2].prior and models[3] is borrowed.fitters[3].prior
    assert borrowed.refits == 0


def _config() -> GreenflowConfig:
    return GreenflowConfig.model_validate(
        {
            "budget": {"period": "day", "limit_kg_co2e": 100.0, "enforcement": "soft"},
            "carbon": {"provider": "synthetic", "conservative_intensity_g_per_kwh": 300},
            "planner": {"slot_s": 600, "horizon_s": 14_400, "solver_time_limit_s": 1.0},
        }
    )


def _queued(factory: sessionmaker[Session], count: int, first: int) -> None:
    now = utcnow()
    with transaction(factory) as session:
        for i in range(first, first + count):
            session.add(
                Job(
                    owner="bob",
                    name=f"q{i}",
                    workload="resnet50",
                    global_batch_size=256,
                    total_samples=50_000_000,
                    min_gpus=1,
                    max_gpus=1,
                    state=JobState.QUEUED.value,
                    state_reason="submitted",
                    created_at=now,
                    updated_at=now,
                )
            )


def _request(name: str) -> JobRequest:
    return JobRequest.model_validate(
        {
            "name": name,
            "workload": "resnet50",
            "global_batch_size": 256,
            "total_samples": 256_000,
            "min_gpus": 1,
            "max_gpus": 2,
            "deadline": (utcnow() + timedelta(hours=3)).isoformat(),
        }
    )


def test_a_burst_is_admitted_one_at_a_time_on_the_plan_in_force_without_a_solve(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = _config()
    with transaction(factory) as session:
        add_node(session, "n1", 8, last_heartbeat_at=utcnow())
    # Three long queued jobs of one GPU each, without deadlines: promises may take their GPUs.
    _queued(factory, 3, 0)
    loop = ControlLoop(config, factory, engine)

    async def tick() -> None:
        try:
            await loop.tick()
        finally:
            await loop.agents.aclose()

    admission = Admission(config, lambda: loop.previous)
    alice = Principal(name="alice", role=Role.USER, token_id="t")

    def submit(name: str) -> None:
        with transaction(factory) as session:
            service.submit_job(session, alice, _request(name), config, admission)

    def selects_of_one_check(name: str) -> int:
        with _count_selects(engine) as selects:
            submit(name)
        return len(selects)

    try:
        asyncio.run(tick())
        assert loop.previous is not None
        threads = [threading.Thread(target=submit, args=(f"burst{i}",)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with transaction(factory) as session:
            states = list(session.scalars(select(Job.state).where(Job.name.like("burst%"))))
        assert states == [JobState.QUEUED.value] * 8
        # Eight deadlines checked against the plan and each other's promises: no solve, and
        # never two checks at once.
        assert admission.stats.checks == 8
        assert admission.stats.solves == 0
        assert admission.stats.most_at_once == 1
        assert 1 <= admission.stats.snapshots <= 8
        # Ten times the queued jobs, the same number of SELECTs per check (none per job), each
        # check on a snapshot of its own.
        admission.snapshot_reuse_s = 0.0
        selects_of_one_check("warm")
        few = selects_of_one_check("few")
        _queued(factory, 30, 3)
        selects_of_one_check("warm-more")
        many = selects_of_one_check("many")
        assert many == few
        # A request that waited while another check read the snapshot (its time is before the
        # read) checks on that snapshot, not on one of its own: a burst reads once.
        waited_since = utcnow()
        with transaction(factory) as session:
            admission.check(session, _request("reader"), 256_000, utcnow())
            read = admission.stats.snapshots
            admission.snapshot_reuse_s = 3600.0
            admission.check(session, _request("waiter"), 256_000, waited_since)
        assert admission.stats.snapshots == read
    finally:
        engine.dispose()


def test_a_full_solve_runs_outside_the_request_transaction(
    database_url: str,  # noqa: F811 (fixture)
    monkeypatch: Any,
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = _config()
    with transaction(factory) as session:
        add_node(session, "n1", 8, last_heartbeat_at=utcnow())
    # No plan in force: the incremental check cannot tell, admission solves.
    admission = Admission(config)
    alice = Principal(name="alice", role=Role.USER, token_id="t")
    seen: list[bool] = []
    real_admit = admission_module.admit

    try:
        with transaction(factory) as session:

            def spying_admit(*args: Any, **kwargs: Any) -> Any:
                seen.append(session.in_transaction())
                return real_admit(*args, **kwargs)

            monkeypatch.setattr(admission_module, "admit", spying_admit)
            result = service.submit_job(session, alice, _request("solved"), config, admission)
        assert admission.stats.solves == 1
        assert seen == [False]
        assert result.created
        with transaction(factory) as session:
            stored = session.scalars(select(Job).where(Job.name == "solved")).one()
            assert stored.state == JobState.QUEUED.value
    finally:
        engine.dispose()


def _two_nodes(
    factory: sessionmaker[Session], *, spannable: bool, count: int = 2, slots: int = 4
) -> None:
    """`count` nodes of `slots` slots each; with `spannable`, each advertised a rendezvous
    address."""
    with transaction(factory) as session:
        for i in range(count):
            add_node(
                session,
                f"n{i}",
                slots,
                agent_url=f"http://127.0.0.1:{9 + i}",
                last_heartbeat_at=utcnow(),
                rendezvous_host=f"198.18.0.{2 + i}" if spannable else None,
                worker_host_port=7000 + i if spannable else None,
            )


def test_a_deadline_job_larger_than_any_node_is_admitted_only_where_it_may_span(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # 6 GPUs at least, nodes of 4: only the two nodes together hold it, as the loop plans it.
    request = _request("wide").model_copy(update={"min_gpus": 6, "max_gpus": 8})
    alice = Principal(name="alice", role=Role.USER, token_id="t")
    for spannable in (True, False):
        engine = make_engine(database_url)
        factory = make_session_factory(engine)
        try:
            with transaction(factory) as session:
                session.execute(delete(GpuSlot))
                session.execute(delete(Node))
                session.execute(delete(Job))
            _two_nodes(factory, spannable=spannable)
            admission = Admission(_config())
            if spannable:
                with transaction(factory) as session:
                    result = service.submit_job(session, alice, request, _config(), admission)
                assert result.created and result.job.state == JobState.QUEUED.value
            else:
                with (
                    pytest.raises(FieldError, match="a job gets at most 4"),
                    transaction(factory) as session,
                ):
                    service.submit_job(session, alice, request, _config(), admission)
        finally:
            engine.dispose()


def test_a_deadline_is_refused_when_its_plan_cannot_be_placed_on_the_nodes(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # Three 8-GPU nodes with 5, 5 and 6 one-GPU deadline jobs running: 8 GPUs are free, 3, 3
    # and 2 per node. Pooled capacity admits an 8-GPU deadline job; placed, it fits only across
    # the nodes: making one node whole moves at least 5 jobs, more than placement moves for one
    # job (`MOVE_MOST_JOBS`). (Two 2-GPU jobs on two 4-GPU nodes, this test's case before
    # placement moved running jobs, now place: one moves.) With a plan in force the check on its
    # spare GPUs says so too (pooled), then placement decides.
    request = _request("eight").model_copy(update={"min_gpus": 8, "max_gpus": 8})
    for spannable, in_force in itertools.product((True, False), (False, True)):
        engine = make_engine(database_url)
        factory = make_session_factory(engine)
        try:
            with transaction(factory) as session:
                session.execute(delete(GpuSlot))
                session.execute(delete(Node))
                session.execute(delete(Job))
                session.execute(delete(Plan))
            _two_nodes(factory, spannable=spannable, count=3, slots=8)
            now = utcnow()
            with transaction(factory) as session:
                running = []
                nodes = session.scalars(select(Node).order_by(Node.name))
                for node, count in zip(nodes, (5, 5, 6), strict=True):
                    slots = session.scalars(
                        select(GpuSlot).where(GpuSlot.node_id == node.id).order_by(GpuSlot.index)
                    ).all()
                    for slot in slots[:count]:
                        # 10,000 s of work on one GPU (the prior's 450 samples/s), due in 3 h.
                        job = Job(
                            owner="bob",
                            name=f"on-{node.name}-{slot.index}",
                            workload="resnet50",
                            global_batch_size=256,
                            total_samples=4_500_000,
                            min_gpus=1,
                            max_gpus=1,
                            current_gpus=1,
                            deadline_at=now + timedelta(hours=3),
                            state=JobState.RUNNING.value,
                            state_reason="running",
                            created_at=now,
                            updated_at=now,
                        )
                        session.add(job)
                        session.flush()
                        running.append(job.id)
                        slot.job_id = job.id
                if in_force:
                    AllocationRepository(session).add_plan(
                        Plan(
                            start_at=now,
                            slot_s=SLOT_S,
                            policy="greenflow",
                            status="feasible",
                            gap=None,
                            solve_s=0.0,
                            energy_kwh=0.0,
                            emissions_kg=0.0,
                            slots=[],
                        ),
                        {str(j): [1] * 24 for j in running},
                        {},
                    )
            admission = Admission(_config())
            with transaction(factory) as session:
                result = admission.check(session, request, 512_000, utcnow())
            decision = result.decision
            case = f"spannable={spannable} in_force={in_force}"
            if spannable:
                assert decision.admitted and decision.guaranteed, (case, decision.reason)
                # On the plan in force the spare GPUs tell, without a solve.
                assert admission.stats.solves == (0 if in_force else 1), case
            else:
                assert not decision.admitted and not decision.guaranteed, case
                assert decision.reason.startswith(
                    "rejected: the plan cannot be placed on the cluster's nodes:"
                ), (case, decision.reason)
                assert "this job" in decision.reason
                # The plan it refuses is the one pooled capacity admits.
                assert decision.plan is not None and decision.plan.deadline_met["new"], case
                assert admission.stats.solves == 1, case
        finally:
            engine.dispose()


def _two_gpu_cluster(factory: sessionmaker[Session]) -> None:
    with transaction(factory) as session:
        add_node(session, "n1", 2, last_heartbeat_at=utcnow())


def _whole_cluster_request(name: str, queue: str = "default") -> JobRequest:
    # Both GPUs (about 900 samples/s by the prior) for about 40 of the 60 minutes before the
    # deadline: one such job fits, two do not.
    return JobRequest.model_validate(
        {
            "name": name,
            "workload": "resnet50",
            "queue": queue,
            "global_batch_size": 256,
            "total_samples": 2_160_000,
            "min_gpus": 2,
            "max_gpus": 2,
            "deadline": (utcnow() + timedelta(hours=1)).isoformat(),
        }
    )


def _queued_names(factory: sessionmaker[Session]) -> list[str]:
    with transaction(factory) as session:
        return sorted(
            session.scalars(select(Job.name).where(Job.state == JobState.QUEUED.value)).all()
        )


@pytest.fixture
def postgres_factory(
    postgres_server: str,  # noqa: F811 (fixture)
) -> Iterator[sessionmaker[Session]]:
    """Sessions on a fresh PostgreSQL database with one node of two GPUs."""
    url, drop = fresh_postgres_database(postgres_server)
    migrate.upgrade(url)
    engine = make_engine(url)
    factory = make_session_factory(engine)
    try:
        _two_gpu_cluster(factory)
        yield factory
    finally:
        engine.dispose()
        drop()  # type: ignore[operator]


ALICE = Principal(name="alice", role=Role.USER, token_id="t")


def test_a_promise_still_committing_counts_in_the_full_solve(
    postgres_factory: sessionmaker[Session],
) -> None:
    # No plan in force, so every check is a full solve. The second check's snapshot cannot list
    # the first job (its transaction is still open), but the first job's promise must count.
    factory, config = postgres_factory, _config()
    admission = Admission(config)
    with transaction(factory) as first:
        service.submit_job(first, ALICE, _whole_cluster_request("first"), config, admission)
        with transaction(factory) as second, pytest.raises(FieldError, match="deadline"):
            service.submit_job(second, ALICE, _whole_cluster_request("second"), config, admission)
    assert admission.stats.solves == 2
    assert _queued_names(factory) == ["first"]


def test_a_burst_of_full_solves_promises_the_gpus_once(
    postgres_factory: sessionmaker[Session],
) -> None:
    factory, config = postgres_factory, _config()
    admission = Admission(config)
    start = threading.Barrier(4)
    refused: list[str] = []

    def submit(name: str) -> None:
        start.wait()
        try:
            with transaction(factory) as session:
                service.submit_job(session, ALICE, _whole_cluster_request(name), config, admission)
        except FieldError:
            refused.append(name)

    threads = [threading.Thread(target=submit, args=(f"burst{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    admitted = _queued_names(factory)
    assert len(admitted) == 1 and len(refused) == 3, (admitted, refused)
    assert admission.stats.most_at_once == 1


def test_a_submission_that_is_not_stored_leaves_no_promise(
    postgres_factory: sessionmaker[Session], monkeypatch: Any
) -> None:
    factory, config = postgres_factory, _config()
    admission = Admission(config)
    # The insert fails after the check: the promise is withdrawn.
    real_insert = JobRepository.insert_submitted

    def failing_insert(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the insert fails")

    monkeypatch.setattr(JobRepository, "insert_submitted", failing_insert)
    with pytest.raises(RuntimeError), transaction(factory) as session:
        service.submit_job(session, ALICE, _whole_cluster_request("lost"), config, admission)
    monkeypatch.setattr(JobRepository, "insert_submitted", real_insert)
    # Stored, then rolled back (the request fails before its commit): the promise goes too.
    with pytest.raises(RuntimeError), transaction(factory) as session:
        service.submit_job(session, ALICE, _whole_cluster_request("rolled"), config, admission)
        raise RuntimeError("the request fails before its commit")
    # Neither holds the GPUs: a job that needs all of them is promised them.
    with transaction(factory) as session:
        service.submit_job(session, ALICE, _whole_cluster_request("kept"), config, admission)
    assert _queued_names(factory) == ["kept"]
    assert admission.stats.checks == 3


def test_a_submission_is_refused_by_its_teams_hard_budget_only(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    # Team nlp's hard budget (1 g a day) pays for seconds of a two-GPU job; vision's for days.
    config = GreenflowConfig.model_validate(
        {
            "budget": {
                "period": "day",
                "limit_kg_co2e": 100.0,
                "enforcement": "soft",
                "teams": {
                    "nlp": {"queues": ["nlp"], "limit_kg_co2e": 0.001, "enforcement": "hard"},
                    "vision": {"queues": ["vision"], "limit_kg_co2e": 50.0, "enforcement": "hard"},
                },
            },
            "carbon": {"provider": "synthetic", "conservative_intensity_g_per_kwh": 300},
            "planner": {"slot_s": 600, "horizon_s": 14_400, "solver_time_limit_s": 1.0},
        }
    )
    try:
        _two_gpu_cluster(factory)
        admission = Admission(config)
        refused = pytest.raises(FieldError, match="team 'nlp' hard carbon budget")
        with refused, transaction(factory) as session:
            request = _whole_cluster_request("nlp-job", queue="nlp")
            service.submit_job(session, ALICE, request, config, admission)
        with transaction(factory) as session:
            request = _whole_cluster_request("vision-job", queue="vision")
            service.submit_job(session, ALICE, request, config, admission)
        assert _queued_names(factory) == ["vision-job"]
    finally:
        engine.dispose()
