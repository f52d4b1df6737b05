"""Batched dispatch queries (one query per tick, not per job) on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select

from scheduler_service.db.models import Allocation, GpuSlot, Job, Node, Plan, PlanJob
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.dispatch.service import stop_finished_jobs
from scheduler_service.nodes.repository import NodeRepository


def _job(name: str, state: str) -> Job:
    now = datetime.now(UTC)
    return Job(
        owner="alice",
        name=name,
        workload="mlp-tiny",
        global_batch_size=8,
        total_samples=80,
        min_gpus=1,
        max_gpus=4,
        state=state,
        state_reason="",
        created_at=now,
        updated_at=now,
    )


def test_newest_commands_slots_and_stops_of_finished_jobs(database_url: str) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    with transaction(factory) as session:
        running, paused, done, stopped = (
            _job("running", "RUNNING"),
            _job("paused", "DEFERRED"),
            _job("done", "SUCCEEDED"),
            _job("stopped", "CANCELLED"),
        )
        node = Node(name="n1", agent_url="http://127.0.0.1:1")
        session.add_all([running, paused, done, stopped, node])
        session.flush()
        session.add_all(
            [
                GpuSlot(node_id=node.id, index=1, job_id=running.id),
                GpuSlot(node_id=node.id, index=0, job_id=running.id),
                GpuSlot(node_id=node.id, index=2, job_id=done.id),
                GpuSlot(node_id=node.id, index=3, job_id=None),
            ]
        )
        commands = [
            (running, 1, 1, "acked"),
            (running, 2, 2, "pending"),
            (paused, 1, 2, "acked"),
            (paused, 2, 0, "acked"),
            (done, 1, 1, "acked"),
            (stopped, 1, 2, "acked"),
            (stopped, 2, 0, "acked"),
        ]
        for job, generation, gpus, status in commands:
            session.add(
                Allocation(
                    job_id=job.id,
                    generation=generation,
                    node_id=node.id,
                    gpus=gpus,
                    slot_indices=list(range(gpus)),
                    status=status,
                )
            )
        ids = {j.name: j.id for j in (running, paused, done, stopped)}

    with transaction(factory) as session:
        repo = AllocationRepository(session)
        newest = repo.newest_by_job()
        assert {ids[n]: newest[ids[n]].generation for n in ids} == {
            ids["running"]: 2,
            ids["paused"]: 2,
            ids["done"]: 1,
            ids["stopped"]: 2,
        }
        acked = repo.newest_by_job([ids["running"], ids["paused"]], acked=True)
        assert set(acked) == {ids["running"], ids["paused"]}
        assert acked[ids["running"]].generation == 1
        assert (acked[ids["paused"]].generation, acked[ids["paused"]].gpus) == (2, 0)
        # Both in one query: the same rows.
        every = sorted(ids.values())
        both = repo.newest_and_newest_acked(every)
        assert {j: a.generation for j, a in both[0].items()} == {
            j: newest[j].generation for j in every
        }
        assert {j: a.generation for j, a in both[1].items()} == {
            j: a.generation for j, a in repo.newest_by_job(every, acked=True).items()
        }
        assert both[1][ids["running"]].generation == 1 and both[0][ids["running"]].generation == 2
        slots = NodeRepository(session).slots_of_jobs([ids["running"], ids["paused"]])
        assert list(slots) == [ids["running"]]
        assert [s.index for s in slots[ids["running"]]] == [0, 1]
        # Only the finished job whose newest command still gives it GPUs needs a stop.
        still_running = repo.newest_running_of_jobs_in(["SUCCEEDED", "CANCELLED"])
        assert [a.job_id for a in still_running] == [ids["done"]]
        stop_finished_jobs(session)

    with transaction(factory) as session:
        repo = AllocationRepository(session)
        stop = repo.newest_by_job([ids["done"]])[ids["done"]]
        assert (stop.generation, stop.gpus, stop.status) == (2, 0, "pending")
        assert stop.reason == "stop: job is SUCCEEDED"
        assert NodeRepository(session).slots_of_jobs([ids["done"]]) == {}
        assert repo.newest_running_of_jobs_in(["SUCCEEDED", "CANCELLED"]) == []
    engine.dispose()


def test_pruning_plans_takes_their_per_job_rows_with_them(database_url: str) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = datetime.now(UTC)
    with transaction(factory) as session:
        repo = AllocationRepository(session)
        for index in range(5):
            repo.add_plan(
                Plan(
                    start_at=now,
                    slot_s=600.0,
                    policy="greenflow",
                    status="OPTIMAL",
                    solve_s=0.1,
                    energy_kwh=1.0,
                    emissions_kg=0.1,
                    slots=[{}, {}],
                ),
                {"1": [index, 1], "2": [1, 0]},
                {"2": f"reason {index}"},
            )
    with transaction(factory) as session:
        AllocationRepository(session).prune_plans(2)
    with factory() as session:
        repo = AllocationRepository(session)
        plans = list(session.scalars(select(Plan).order_by(Plan.id)))
        rows = list(session.scalars(select(PlanJob).order_by(PlanJob.plan_id, PlanJob.job_id)))
        header = repo.latest_plan_header()
        assert header is not None
        newest = repo.plan_jobs(header.id)
        totals = header.total_gpus
    engine.dispose()
    assert len(plans) == 2 and [p.num_slots for p in plans] == [2, 2]
    assert {r.plan_id for r in rows} == {p.id for p in plans} and len(rows) == 4
    assert [(r.job_id, r.gpus, r.deadline_miss) for r in newest] == [
        (1, [4, 1], None),
        (2, [1], "reason 4"),  # stored without its trailing zero
    ]
    assert totals == [5, 1]
