"""The console's pages and /v1/plan run a fixed number of SQL statements, however many jobs exist."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, event, func, select
from sqlalchemy.orm import Session

from scheduler_service.auth.service import Principal
from scheduler_service.auth.tokens import Role
from scheduler_service.console import service as pages
from scheduler_service.db.models import GpuSlot, Job, JobEvent, Node, Plan, TelemetrySample
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.dispatch.router import current_plan
from scheduler_service.settings import GreenflowConfig

NOW = datetime.now(UTC).replace(microsecond=0)
OPERATOR = Principal(name="ops", role=Role.OPERATOR, token_id="t-ops")
ALICE = Principal(name="alice", role=Role.USER, token_id="t-alice")

# Each group of this many jobs holds one of each kind below.
KINDS = (
    "running-late",
    "running-fine",
    "running-planned-miss",
    "queued-overdue",
    "queued-planned-miss",
    "queued",
    "done",
)


@contextmanager
def counted(engine: Engine) -> Iterator[list[str]]:
    """The SQL statements run on `engine` inside the block."""
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", record)


def _job(index: int, kind: str) -> Job:
    state = "RUNNING" if kind.startswith("running") else "SUCCEEDED" if kind == "done" else "QUEUED"
    deadline = NOW - timedelta(hours=1) if kind == "queued-overdue" else NOW + timedelta(hours=2)
    return Job(
        owner="alice" if index % 2 == 0 else "bob",
        name=f"{kind}-{index}",
        workload="gpt2",
        global_batch_size=8,
        total_samples=8_000_000 if kind == "running-late" else 8_000,
        min_gpus=1,
        max_gpus=2,
        deadline_at=deadline,
        state=state,
        state_reason="seeded",
        current_gpus=1 if state == "RUNNING" else 0,
        created_at=NOW - timedelta(hours=3),
        updated_at=NOW - timedelta(hours=3),
    )


def seed_jobs(session: Session, groups: int, node: Node | None) -> list[Job]:
    """`groups` x KINDS jobs with events and telemetry, and a new current plan naming all jobs."""
    start = session.scalar(select(func.count(Job.id))) or 0
    jobs = [_job(start + i, KINDS[i % len(KINDS)]) for i in range(groups * len(KINDS))]
    session.add_all(jobs)
    session.flush()
    for job in jobs:
        session.add(JobEvent(job_id=job.id, at=NOW, kind="state", to_state=job.state))
        if job.state == "RUNNING":
            for k in range(7):
                session.add(
                    TelemetrySample(
                        sample_id=f"s{job.id}-{k}",
                        job_id=job.id,
                        node_id=node.id if node else None,
                        at=NOW - timedelta(seconds=10 * (7 - k)),
                        interval_s=10,
                        step=k,
                        samples_done=8 * k,
                        samples_per_s=10.0,
                        gpus=1,
                        power_w=100,
                        energy_kwh=0.0001,
                        power_source="estimated",
                    )
                )
    names = {job_id: name for job_id, name in session.execute(select(Job.id, Job.name))}
    every = sorted(names)
    AllocationRepository(session).add_plan(
        Plan(
            start_at=NOW,
            slot_s=600.0,
            policy="greenflow",
            status="OPTIMAL",
            gap=0.0,
            solve_s=0.1,
            energy_kwh=1.0,
            emissions_kg=0.1,
            slots=[{"capacity_gpus": 8}] * 4,
        ),
        {str(job_id): [1, 1, 0, 0] for job_id in every},
        {str(job_id): "not enough GPUs" for job_id in every if "planned-miss" in names[job_id]},
    )
    return jobs


def _reads(session: Session, job_id: int) -> dict[str, Callable[[], object]]:
    config = GreenflowConfig()
    return {
        "overview (operator)": lambda: pages.overview(session, OPERATOR, config, NOW),
        "overview (user)": lambda: pages.overview(session, ALICE, config, NOW),
        "carbon page (user)": lambda: pages.carbon_page(session, ALICE, config, NOW),
        "job page": lambda: pages.job_page(session, session.get_one(Job, job_id), NOW),
        "/v1/plan (user)": lambda: current_plan(session, ALICE, None),
        "/v1/plan?job=": lambda: current_plan(session, OPERATOR, job_id),
    }


def _count_statements(engine: Engine, job_id: int) -> dict[str, int]:
    counts = {}
    factory = make_session_factory(engine)
    for name in _reads(Session(), job_id):
        with factory() as session, counted(engine) as statements:
            _reads(session, job_id)[name]()
        counts[name] = len(statements)
    return counts


def test_reads_run_as_many_statements_at_60_jobs_as_at_6(database_url: str) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    with transaction(factory) as session:
        node = Node(name="n1", agent_url="http://127.0.0.1:1")
        session.add(node)
        session.flush()
        session.add_all(GpuSlot(node_id=node.id, index=i) for i in range(8))
        first = seed_jobs(session, 1, node)
    job_id = first[0].id
    few = _count_statements(engine, job_id)
    with transaction(factory) as session:
        seed_jobs(session, 9, session.get(Node, node.id))
    many = _count_statements(engine, job_id)
    engine.dispose()
    assert many == few
    # Bounded, not merely equal: a handful per page (plus one per chart or table shown).
    assert all(count <= 25 for count in many.values()), many


def test_overview_lists_every_kind_of_risk_and_counts_them(database_url: str) -> None:
    engine = make_engine(database_url)
    with transaction(make_session_factory(engine)) as session:
        seed_jobs(session, 3, None)
    with make_session_factory(engine)() as session:
        view = pages.overview(session, OPERATOR, GreenflowConfig(), NOW)
        mine = pages.overview(session, ALICE, GreenflowConfig(), NOW)
        risky = sorted(r.job.name.rsplit("-", 1)[0] for r in view.risks)
        reasons = {r.job.name: r.plan_reason for r in view.risks}
        plan = current_plan(session, ALICE, None)
        alices = set(session.scalars(select(Job.id).where(Job.owner == "alice")))
    engine.dispose()
    expected = ["running-late", "running-planned-miss", "queued-overdue", "queued-planned-miss"]
    assert risky == sorted(expected * 3)
    assert view.risks_total == 12
    assert all(
        reasons[name] == ("not enough GPUs" if "planned-miss" in name else None) for name in reasons
    )
    assert {r.job.owner for r in mine.risks} == {"alice"} and mine.risks_total < 12
    # A user's plan holds exactly their own jobs' rows.
    assert {int(job_id) for job_id in plan.gpus_by_job} == alices
    assert {int(job_id) for job_id in plan.deadline_misses} <= alices
    assert len(plan.slots) == 4
