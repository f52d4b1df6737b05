"""The live loop keeps a planned count by placing another job elsewhere, on PostgreSQL: the loop
(`dispatch.decide`) and admission's check (the snapshot's `NodeFacts`) place on the same facts,
and the moved job's events say why it left its home node and what it resumed from."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from scheduler_service.allocation.problem import make_plan
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, GpuSlot, Job, JobEvent
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.dispatch.service import (
    decide,
    loop_node_facts,
    planned_plain_rows,
    record_ack,
)
from scheduler_service.jobs.states import JobState
from scheduler_service.placement import place_jobs
from scheduler_service.planning import JobModels, read_snapshot
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.service.test_budget_watchdog import _add_job, _config
from tests.service.test_snapshot import _forecast
from tests.support.rows import add_node
from worker_agent.protocol import AllocationAck


def test_a_paused_job_is_placed_off_its_home_so_a_running_job_keeps_its_planned_count(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # Nodes a and b, 4 GPUs each, not spannable (no rendezvous address): every job runs inside
    # one node. x runs on a's slots 0-1 and is planned 4; y (higher priority, placed first) is
    # paused with its state on a, planned 2. Back on its home a, y leaves x 2 GPUs (no node has
    # 4 free around x); y on b lets x grow to 4 in place.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = _config(limit_kg=1000.0)
    now = utcnow()
    with transaction(factory) as session:
        a = add_node(session, "a", 4, state="ready", last_heartbeat_at=now).id
        b = add_node(session, "b", 4, state="ready", last_heartbeat_at=now).id
    x = _add_job(
        factory, name="x", state=JobState.RUNNING.value, state_reason="running",
        total_samples=10**8, created_at=now, updated_at=now, current_gpus=2,
    )  # fmt: skip
    y = _add_job(
        factory, name="y", state=JobState.DEFERRED.value, state_reason="paused",
        priority=5, total_samples=10**8, samples_done=2560, step=10, created_at=now,
        updated_at=now,
    )  # fmt: skip
    with transaction(factory) as session:
        for slot in session.scalars(select(GpuSlot).where(GpuSlot.node_id == a)):
            slot.job_id = x if slot.index < 2 else None
        acked = {"status": "acked", "acked_at": now - timedelta(minutes=1)}
        session.add(
            Allocation(job_id=x, generation=1, node_id=a, gpus=2, slot_indices=[0, 1], **acked)
        )
        session.add(
            Allocation(job_id=y, generation=1, node_id=a, gpus=2, slot_indices=[2, 3], **acked)
        )
        session.add(Allocation(job_id=y, generation=2, node_id=a, gpus=0, slot_indices=[], **acked))  # fmt: skip

    try:
        with transaction(factory) as session:
            planning = read_snapshot(session, config, _forecast(), JobModels(), now)
        rows = {str(x): (4,), str(y): (2,)}
        problem = planning.problem
        plan = make_plan(
            problem,
            {k: r * problem.num_slots for k, r in rows.items()},
            status="test",
            policy="test",
            solve_s=0.0,
        )
        facts = planning.nodes
        assert facts.homes == {y: a} and facts.current[x].parts == ((a, (0, 1)),)
        order = [y, x]
        allowed = {int(j.job_id): j.allowed_gpus for j in problem.jobs}
        # Admission's check counts both planned counts as placeable ...
        assert facts.place_rows({x: (4,), y: (2,)}, allowed, order) == {x: (4,), y: (2,)}
        # ... which placement that moves no job would not hold: x would run on 2.
        still = place_jobs(
            {x: 4, y: 2}, facts.current, facts.nodes, allowed, order, home=facts.homes
        )
        assert still.placements[x].gpus == 2 and x in still.short

        with transaction(factory) as session:
            # The loop's facts, read in its writing transaction, are the snapshot's.
            newest, newest_acked = AllocationRepository(session).newest_and_newest_acked([x, y])
            plain = planned_plain_rows(session, planning)
            assert loop_node_facts(session, [x, y], plain, newest, newest_acked, now, None) == facts
            assert decide(session, planning, plan, now) == 2

        with transaction(factory) as session:
            newest, _ = AllocationRepository(session).newest_and_newest_acked([x, y])
            held = {
                (s.node_id, s.index): s.job_id
                for s in session.scalars(select(GpuSlot).where(GpuSlot.job_id.is_not(None)))
            }
            events = list(
                session.scalars(select(JobEvent).where(JobEvent.job_id == y).order_by(JobEvent.id))
            )
            command_y = newest[y]
            assert (newest[x].node_id, sorted(newest[x].slot_indices)) == (a, [0, 1, 2, 3])
            assert newest[x].reason == "plan: 2 -> 4 GPUs"
            assert (command_y.node_id, command_y.gpus, command_y.generation) == (b, 2, 3)
            assert held == {
                (a, 0): x, (a, 1): x, (a, 2): x, (a, 3): x,
                (b, command_y.slot_indices[0]): y, (b, command_y.slot_indices[1]): y,
            }  # fmt: skip
            why = (
                f"placed on node {b}, not on its home node {a} where its paused state is, to "
                f"make room for job {x}'s 4 GPUs on node {a}"
            )
            assert why in (command_y.reason or "")
            move = [e for e in events if e.kind == "placement_move"]
            assert [e.reason for e in move] == [f"placement: {why}"]
            assert move[0].details == {"node": b, "gpus": 2, "generation": 3}
            command_id = command_y.id

        # b has no checkpoint of y: it starts from step 0, and the start's event says so and
        # what is trained again (the samples done since).
        with transaction(factory) as session:
            ack = AllocationAck(
                job_id=y, generation=3, gpus=2, layout="dp2-tp1-pp1", step=0,
                worker_pids=[11, 12], resumed_from="start",
            )  # fmt: skip
            record_ack(session, command_id, ack)
        with transaction(factory) as session:
            job = session.get(Job, y)
            assert job is not None and job.state == JobState.RUNNING.value
            started = session.scalars(
                select(JobEvent).where(JobEvent.job_id == y, JobEvent.kind == "allocation")
            ).one()
            assert started.reason == (
                "started on 2 GPUs (dp2-tp1-pp1) at step 0, resumed from step 0; 2560 samples "
                "trained since then are redone"
            )
            assert job.samples_done == 0
    finally:
        engine.dispose()
