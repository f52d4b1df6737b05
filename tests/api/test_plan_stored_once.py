"""A plan's GPUs per job and slot and its deadline misses are stored once, as `plan_jobs` rows
(trailing zeros trimmed), and read back as the solver's plan had them: by `/v1/plan`, admission's
plan in force, and through a downgrade and upgrade of the schema."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from sqlalchemy import inspect, select, text

from scheduler_service.auth.service import Principal, Role
from scheduler_service.db import migrate
from scheduler_service.db.models import Job, Plan, PlanJob
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.plans import plan_contents
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.dispatch.router import current_plan
from tests.api.conftest import database_url, postgres_server  # noqa: F401

OPERATOR = Principal(name="ops", role=Role.OPERATOR, token_id="t-ops")
ALICE = Principal(name="alice", role=Role.USER, token_id="t-alice")
NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)


def _store(url: str) -> tuple[dict[str, list[int]], dict[str, str], dict[str, str]]:
    """Three of alice's jobs and one of bob's, and a plan over 6 slots naming them (and a job
    only for its miss); the plan's GPUs, misses, and each job's owner."""
    engine = make_engine(url)
    factory = make_session_factory(engine)
    owners: dict[str, str] = {}
    with transaction(factory) as session:
        for name, owner in (("a", "alice"), ("b", "alice"), ("c", "alice"), ("d", "bob")):
            job = Job(
                owner=owner,
                name=name,
                workload="resnet50",
                global_batch_size=256,
                min_gpus=1,
                max_gpus=8,
                total_samples=10**6,
                state="QUEUED",
            )
            session.add(job)
            session.flush()
            owners[str(job.id)] = owner
        a, b, c, d = sorted(owners, key=int)
        gpus = {
            a: [2, 4, 4, 0, 0, 0],  # trailing zeros
            b: [0, 0, 0, 0, 0, 0],  # planned none
            c: [1, 0, 1, 0, 1, 1],  # runs to the horizon
            d: [0, 0, 8, 8, 0, 0],
        }
        misses = {b: "no GPUs before its deadline", "999": "a job the plan names only here"}
        AllocationRepository(session).add_plan(
            Plan(
                start_at=NOW,
                slot_s=600.0,
                policy="greenflow",
                status="heuristic",
                solve_s=0.5,
                energy_kwh=1.0,
                emissions_kg=0.2,
                slots=[{"capacity_gpus": 16}] * 6,
            ),
            gpus,
            misses,
        )
    engine.dispose()
    return gpus, misses, owners


def test_the_stored_plan_reads_back_as_it_was_planned(database_url: str) -> None:  # noqa: F811
    gpus, misses, owners = _store(database_url)
    a, b, c, d = sorted(owners, key=int)
    engine = make_engine(database_url)
    with make_session_factory(engine)() as session:
        # Stored once: the plans row holds no per-job copy, the rows end at their last GPU.
        assert {"gpus_by_job", "deadline_misses"}.isdisjoint(
            column["name"] for column in inspect(engine).get_columns("plans")
        )
        stored = {str(r.job_id): r.gpus for r in session.scalars(select(PlanJob))}
        assert stored == {a: [2, 4, 4], b: [0], c: [1, 0, 1, 0, 1, 1], d: [0, 0, 8, 8], "999": []}
        plan = session.scalars(select(Plan)).one()
        assert (plan.num_slots, plan.total_gpus) == (6, [3, 4, 13, 8, 1, 1])

        everything = current_plan(session, OPERATOR, None)
        assert everything.gpus_by_job == gpus
        assert everything.deadline_misses == misses
        assert len(everything.slots) == 6

        mine = current_plan(session, ALICE, None)
        assert mine.gpus_by_job == {k: v for k, v in gpus.items() if owners[k] == "alice"}
        assert mine.deadline_misses == {b: misses[b]}

        one = current_plan(session, ALICE, int(a))
        assert (one.gpus_by_job, one.deadline_misses) == ({a: gpus[a]}, {})
    engine.dispose()


def test_a_downgrade_puts_the_plan_back_in_its_json_columns_and_an_upgrade_reads_it_again(
    database_url: str,  # noqa: F811
) -> None:
    gpus, misses, _ = _store(database_url)
    migrate.downgrade(database_url, "a2b4c6d8e0f1")
    engine = make_engine(database_url)
    with engine.connect() as conn:
        gpus_raw, misses_raw = conn.execute(
            text("SELECT gpus_by_job, deadline_misses FROM plans")
        ).one()
    engine.dispose()
    loaded = [json.loads(v) if isinstance(v, str) else v for v in (gpus_raw, misses_raw)]
    assert loaded == [gpus, misses]
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    with make_session_factory(engine)() as session:
        plan = session.scalars(select(Plan)).one()
        rows = list(session.scalars(select(PlanJob).where(PlanJob.plan_id == plan.id)))
        assert plan_contents(rows, plan.num_slots) == (gpus, misses)
    engine.dispose()
