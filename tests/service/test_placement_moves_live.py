"""The live loop keeps a planned count by placing another job elsewhere, on PostgreSQL (and
SQLite): the loop (`dispatch.decide`) and admission's check (the snapshot's `NodeFacts`) place on
the same facts; a paused job placed off its home node and a running job moved to another node get
events that say why and what they resumed from; a running job moves by a pause on its node,
answered before its start on the new node."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from scheduler_service.allocation.problem import make_plan
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, GpuSlot, Job, JobEvent
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.repository import AllocationRepository
from scheduler_service.dispatch.service import (
    decide,
    deliveries,
    loop_node_facts,
    planned_plain_rows,
    record_ack,
    record_failure,
)
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.secrets import NodeSecrets
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
    # Nodes a (4 GPUs) and b (2), not spannable (no rendezvous address): every job runs inside
    # one node. x runs on a's slots 0-1 and is planned 4; y (higher priority, placed first) is
    # paused with its state on a, planned 2. Back on its home a, y leaves x 2 GPUs (b is too
    # small for x's 4); y on b lets x grow to 4 in place.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = _config(limit_kg=1000.0)
    now = utcnow()
    with transaction(factory) as session:
        a = add_node(session, "a", 4, state="ready", last_heartbeat_at=now).id
        b = add_node(session, "b", 2, state="ready", last_heartbeat_at=now).id
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


def _two_running_and_one_new(
    factory: Any, secrets: NodeSecrets, now: datetime
) -> tuple[int, int, int, int, int]:
    """Nodes a, b (4 GPUs each, not spannable); r runs on a's slots 0-1, s on b's 0-1; e is
    queued with a higher priority. Returns (a, b, r, s, e)."""
    keys = {"secret_key_id": secrets.key_id, "agent_secret_nonce": "nonce"}
    with transaction(factory) as session:
        a = add_node(session, "a", 4, state="ready", last_heartbeat_at=now, **keys).id
        b = add_node(session, "b", 4, state="ready", last_heartbeat_at=now, **keys).id
    running = {"state": JobState.RUNNING.value, "state_reason": "running", "current_gpus": 2}
    times = {"total_samples": 10**8, "created_at": now, "updated_at": now}
    r = _add_job(factory, name="r", samples_done=40 * 256, step=40, **running, **times)
    s = _add_job(factory, name="s", **running, **times)
    e = _add_job(
        factory, name="e", state=JobState.QUEUED.value, state_reason="submitted", priority=5,
        **times,
    )  # fmt: skip
    with transaction(factory) as session:
        for slot in session.scalars(select(GpuSlot)):
            slot.job_id = {a: r, b: s}[slot.node_id] if slot.index < 2 else None
        acked = {"status": "acked", "acked_at": now - timedelta(minutes=1)}
        for job_id, node_id in ((r, a), (s, b)):
            session.add(
                Allocation(
                    job_id=job_id, generation=1, node_id=node_id, gpus=2, slot_indices=[0, 1],
                    **acked,
                )
            )  # fmt: skip
    return a, b, r, s, e


def _shared(config: Any) -> Any:
    """`config` with `[cluster] checkpoints_shared = true`: running jobs may move."""
    cluster = config.cluster.model_copy(update={"checkpoints_shared": True})
    return config.model_copy(update={"cluster": cluster})


def _decide_plan(factory: Any, config: Any, now: datetime, rows: dict[int, int]) -> None:
    """The loop's write step for a plan whose every slot asks `rows` (GPUs per job)."""
    with transaction(factory) as session:
        planning = read_snapshot(session, config, _forecast(), JobModels(), now)
    problem = planning.problem
    plan = make_plan(
        problem,
        {str(j): (g,) * problem.num_slots for j, g in rows.items()},
        status="test",
        policy="test",
        solve_s=0.0,
    )
    with transaction(factory) as session:
        decide(session, planning, plan, now, move_running=config.cluster.checkpoints_shared)


def test_a_running_job_keeps_its_node_where_checkpoints_are_not_shared(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # As below, but the agents' checkpoints are node-local (the default): moving r would restart
    # it from an older checkpoint or step 0 on b, so it stays, and e gets what fits (2 GPUs).
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    secrets = NodeSecrets.generate()
    now = utcnow()
    _, _, r, s, e = _two_running_and_one_new(factory, secrets, now)
    try:
        _decide_plan(factory, _config(limit_kg=1000.0), now, {e: 4, r: 2, s: 2})
        with transaction(factory) as session:
            pending = list(
                session.scalars(select(Allocation).where(Allocation.status == "pending"))
            )
            assert [(c.job_id, c.gpus) for c in pending] == [(e, 2)]
            assert "4 GPUs asked, 2 placed" in (pending[0].reason or ""), pending[0].reason
            moves = session.scalars(select(JobEvent).where(JobEvent.kind == "placement_move"))
            assert list(moves) == []
    finally:
        engine.dispose()


def test_a_running_job_moves_by_a_pause_answered_before_its_start_on_the_new_node(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # e's planned 4 GPUs fit on no node as r and s sit (2 free on each): r moves whole from a
    # to b, where 2 are free, and e takes all of a.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    secrets = NodeSecrets.generate()
    now = utcnow()
    a, b, r, s, e = _two_running_and_one_new(factory, secrets, now)
    try:
        _decide_plan(factory, _shared(_config(limit_kg=1000.0)), now, {e: 4, r: 2, s: 2})
        with transaction(factory) as session:
            commands = {
                (c.job_id, c.generation): c
                for c in session.scalars(select(Allocation).where(Allocation.status == "pending"))
            }
            assert set(commands) == {(r, 2), (r, 3), (e, 1)}
            pause, start = commands[r, 2], commands[r, 3]
            why = f"moved whole from node {a} to node {b} to make room for job {e}'s 4 GPUs on node {a}"
            assert (pause.node_id, pause.gpus) == (a, 0)
            assert pause.reason == f"move: paused on node {a} to resume on node {b} ({why})"
            assert (start.node_id, start.gpus) == (b, 2) and why in (start.reason or "")
            assert (commands[e, 1].node_id, sorted(commands[e, 1].slot_indices)) == (
                a,
                [0, 1, 2, 3],
            )
            move = session.scalars(
                select(JobEvent).where(JobEvent.job_id == r, JobEvent.kind == "placement_move")
            ).one()
            assert move.reason == f"placement: {why}"
            # The start waits behind the pause: a's slots must be free and the checkpoint written
            # before r starts on b.
            first = deliveries(session, secrets)
            sent = {(d.command.job_id, d.command.generation): d for d in first}
            assert set(sent) == {(r, 2), (e, 1)}
            assert sent[r, 2].order == 0 and sent[r, 2].blocks and not sent[e, 1].blocks
            pause_id, start_id = pause.id, start.id
        with transaction(factory) as session:
            record_ack(session, pause_id, _ack(r, 2, gpus=0, step=40))
        with transaction(factory) as session:
            job = session.get(Job, r)
            assert job is not None and job.state == JobState.DEFERRED.value
            assert (job.state_reason or "").startswith(f"move: paused on node {a}")
            second = deliveries(session, secrets)
            assert [(d.command.job_id, d.command.generation) for d in second] == [(e, 1), (r, 3)]
        with transaction(factory) as session:
            record_ack(session, start_id, _ack(r, 3, gpus=2, step=40, resumed="checkpoint@step40"))
        with transaction(factory) as session:
            job = session.get(Job, r)
            assert job is not None and job.state == JobState.RUNNING.value
            started = session.scalars(
                select(JobEvent).where(JobEvent.job_id == r, JobEvent.kind == "allocation")
            ).one()
            assert started.reason == (
                "started on 2 GPUs (dp2-tp1-pp1) at step 40, resumed from checkpoint at step40"
            )
    finally:
        engine.dispose()


def test_a_refused_pause_withdraws_the_moves_start_and_gives_the_job_its_slots_back(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    secrets = NodeSecrets.generate()
    now = utcnow()
    a, _, r, s, e = _two_running_and_one_new(factory, secrets, now)
    try:
        _decide_plan(factory, _shared(_config(limit_kg=1000.0)), now, {e: 4, r: 2, s: 2})
        with transaction(factory) as session:
            pause = session.scalars(
                select(Allocation).where(Allocation.job_id == r, Allocation.generation == 2)
            ).one()
            record_failure(session, pause.id, "stale generation", rejected=True)
        with transaction(factory) as session:
            start = session.scalars(
                select(Allocation).where(Allocation.job_id == r, Allocation.generation == 3)
            ).one()
            assert start.status == "superseded"
            held = sorted(
                (slot.node_id, slot.index)
                for slot in session.scalars(select(GpuSlot).where(GpuSlot.job_id == r))
            )
            assert held == [(a, 0), (a, 1)]  # where its agent still runs it
            assert [d.command.job_id for d in deliveries(session, secrets)] == [e]
    finally:
        engine.dispose()


def _ack(job_id: int, generation: int, *, gpus: int, step: int, resumed: str | None = None) -> Any:
    return AllocationAck(
        job_id=job_id,
        generation=generation,
        gpus=gpus,
        layout="dp2-tp1-pp1" if gpus else None,
        step=step,
        worker_pids=[21, 22] if gpus else [],
        resumed_from=resumed,
    )


def test_slots_of_a_job_the_plan_leaves_out_are_not_given_to_another(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # h runs on a's two GPUs and is held (the snapshot plans no held job), q is queued and
    # planned 2 GPUs: neither admission's check nor the loop may give q h's slots.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    config = _config(limit_kg=1000.0)
    now = utcnow()
    with transaction(factory) as session:
        a = add_node(session, "a", 2, state="ready", last_heartbeat_at=now).id
    times = {"total_samples": 10**8, "created_at": now, "updated_at": now}
    h = _add_job(
        factory, name="h", state=JobState.RUNNING.value, state_reason="running", held=True,
        current_gpus=2, **times,
    )  # fmt: skip
    q = _add_job(factory, name="q", state=JobState.QUEUED.value, state_reason="submitted", **times)
    with transaction(factory) as session:
        for slot in session.scalars(select(GpuSlot)):
            slot.job_id = h
        session.add(
            Allocation(
                job_id=h, generation=1, node_id=a, gpus=2, slot_indices=[0, 1], status="acked"
            )
        )
    try:
        with transaction(factory) as session:
            planning = read_snapshot(session, config, _forecast(), JobModels(), now)
        assert [j.job_id for j in planning.problem.jobs] == [str(q)]
        allowed = {q: planning.problem.jobs[0].allowed_gpus}
        assert planning.nodes.place_rows({q: (2,)}, allowed, [q]) == {q: (0,)}
        _decide_plan(factory, config, now, {q: 2})
        with transaction(factory) as session:
            held = {s.index: s.job_id for s in session.scalars(select(GpuSlot))}
            assert held == {0: h, 1: h}
            assert not session.scalars(select(Allocation).where(Allocation.job_id == q)).all()
    finally:
        engine.dispose()
