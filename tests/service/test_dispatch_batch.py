"""Commands to deliver, and the answers to them, are read with a fixed number of queries,
however many there are."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import select

from scheduler_service.control_loop import ControlLoop, _Outcome
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, GpuSlot, Job, Node
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.dispatch.service import deliveries
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.secrets import NodeSecrets
from scheduler_service.settings import GreenflowConfig
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.service.test_snapshot import _count_selects
from worker_agent.protocol import AllocationAck


def test_deliveries_read_every_pending_command_in_a_fixed_number_of_queries(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    secrets = NodeSecrets.generate()
    now = utcnow()

    def add(commands: int, first: int) -> None:
        with transaction(factory) as session:
            node = Node(
                name=f"n{first}",
                agent_url="http://127.0.0.1:9",
                last_heartbeat_at=now,
                secret_key_id=secrets.key_id,
                agent_secret_nonce="nonce",
            )
            session.add(node)
            session.flush()
            session.add_all(GpuSlot(node_id=node.id, index=i) for i in range(8))
            for i in range(commands):
                job = Job(
                    owner="alice", name=f"j{first + i}", workload="resnet50",
                    global_batch_size=256, total_samples=10**9, min_gpus=1, max_gpus=8,
                    state=JobState.RUNNING.value, state_reason="", created_at=now, updated_at=now,
                )  # fmt: skip
                session.add(job)
                session.flush()
                # One acknowledged command (where it runs), one pending (where it goes).
                for generation, status in ((1, "acked"), (2, "pending")):
                    session.add(
                        Allocation(
                            job_id=job.id, generation=generation, node_id=node.id, gpus=1,
                            slot_indices=[i % 8], status=status,
                        )
                    )  # fmt: skip

    def read() -> tuple[int, int]:
        with _count_selects(engine) as selects, transaction(factory) as session:
            found = deliveries(session, secrets)
            # What the ordering needs: a command onto the job's acknowledged slot is a shrink.
            assert all(d.order == 1 for d in found)
        return len(found), len(selects)

    try:
        add(2, 0)
        few, queries_few = read()
        add(20, 100)
        many, queries_many = read()
        assert (few, many) == (2, 22)
        assert queries_many == queries_few
    finally:
        engine.dispose()


def test_answers_recorded_together_read_their_commands_and_jobs_in_a_fixed_number_of_queries(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    loop = ControlLoop(GreenflowConfig(), factory, engine)
    now = utcnow()

    def pending(count: int, first: int) -> list[int]:
        """`count` queued jobs, each with one pending command for 1 GPU; the command ids."""
        ids = []
        with transaction(factory) as session:
            for i in range(count):
                job = Job(
                    owner="alice", name=f"a{first + i}", workload="resnet50",
                    global_batch_size=256, total_samples=10**9, min_gpus=1, max_gpus=8,
                    state=JobState.QUEUED.value, state_reason="", created_at=now, updated_at=now,
                )  # fmt: skip
                session.add(job)
                session.flush()
                command = Allocation(
                    job_id=job.id, generation=1, gpus=1, slot_indices=[0], status="pending"
                )
                session.add(command)
                session.flush()
                ids.append(command.id)
        return ids

    def record(ids: list[int]) -> int:
        with transaction(factory) as session:
            jobs = {a.id: a.job_id for a in session.scalars(select(Allocation))}
        outcomes = [
            _Outcome(i, AllocationAck(job_id=jobs[i], generation=1, gpus=1, layout=None,
                                      step=0, worker_pids=[1], resumed_from="start"), None)
            for i in ids
        ]  # fmt: skip
        with _count_selects(engine) as selects:
            loop._record(outcomes)
        return len(selects)

    try:
        few, many = pending(2, 0), pending(20, 100)
        assert record(few) == record(many)
        with transaction(factory) as session:
            states = set(session.scalars(select(Job.state)))
            commands = set(session.scalars(select(Allocation.status)))
        assert (states, commands) == ({JobState.RUNNING.value}, {"acked"})
    finally:
        engine.dispose()


def test_a_big_group_of_commands_is_sent_a_bounded_number_at_a_time(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    loop = ControlLoop(GreenflowConfig(), make_session_factory(engine), engine)
    in_flight = most = 0

    async def deliver(delivery: Any) -> _Outcome:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        # No such command: recording the failure finds nothing to change.
        return _Outcome(delivery, None, "agent unreachable")

    async def run() -> int:
        loop._sends = asyncio.Semaphore(3)
        loop._deliver = deliver  # type: ignore[method-assign]
        try:
            return len(await loop._deliver_group(list(range(10**6, 10**6 + 20))))  # type: ignore[arg-type]
        finally:
            await loop.agents.aclose()

    try:
        # All sent and recorded, never more than the bound at once (queued sends would spend
        # their timeout waiting for a connection).
        assert asyncio.run(run()) == 20
        assert most == 3
    finally:
        engine.dispose()
