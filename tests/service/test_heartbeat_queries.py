"""A heartbeat reads its node's jobs and their commands in a fixed number of queries."""

from __future__ import annotations

from sqlalchemy import select, update

from scheduler_service.auth.service import Principal
from scheduler_service.auth.tokens import Role
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, GpuSlot, Job, Node
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.service import heartbeat
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.service.test_snapshot import _count_selects
from worker_agent.protocol import Heartbeat, RunningJob

KEY_ID = "key-1"


def _running(job_id: int, slot: int) -> RunningJob:
    return RunningJob(
        job_id=job_id, generation=1, gpus=1, slot_indices=[slot], layout=None, step=1,
        samples_done=1, worker_pids=[],
    )  # fmt: skip


def test_heartbeat_queries_do_not_grow_with_the_jobs_it_reports(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    now = utcnow()

    def node_with(jobs: int, name: str) -> tuple[list[int], int, int, int]:
        """A node holding `jobs` running jobs (one slot each, acknowledged), plus one job moved
        to another node, one finished job the agent still runs, and one job held here that the
        agent no longer reports; returns their ids."""
        with transaction(factory) as session:
            node = Node(
                name=name, agent_url="http://127.0.0.1:9", last_heartbeat_at=now,
                secret_key_id=KEY_ID, agent_secret_nonce="nonce", state="ready",
            )  # fmt: skip
            other = Node(name=f"{name}-other", agent_url="http://127.0.0.1:9", state="ready")
            session.add_all([node, other])
            session.flush()
            session.add_all(GpuSlot(node_id=node.id, index=i) for i in range(jobs + 1))
            ids: list[int] = []
            for i in range(jobs + 3):
                state = JobState.SUCCEEDED if i == jobs + 1 else JobState.RUNNING
                job = Job(
                    owner="alice", name=f"{name}-{i}", workload="resnet50",
                    global_batch_size=256, total_samples=10**9, min_gpus=1, max_gpus=8,
                    state=state.value, state_reason="", created_at=now, updated_at=now,
                )  # fmt: skip
                session.add(job)
                session.flush()
                ids.append(job.id)
                # Job `jobs` moved to the other node, acknowledged there.
                target = other.id if i == jobs else node.id
                session.add(
                    Allocation(
                        job_id=job.id, generation=1, node_id=target, gpus=1,
                        slot_indices=[i % (jobs + 1)], status="acked",
                    )
                )  # fmt: skip
            held = [*ids[:jobs], ids[jobs + 2]]
            for index, job_id in enumerate(held):
                session.execute(
                    update(GpuSlot)
                    .where(GpuSlot.node_id == node.id, GpuSlot.index == index)
                    .values(job_id=job_id)
                )
        return ids[:jobs], ids[jobs], ids[jobs + 1], ids[jobs + 2]

    def beat(name: str, running: list[int], moved: int, finished: int) -> tuple[list[int], int]:
        reported = [_running(job_id, i) for i, job_id in enumerate([*running, moved, finished])]
        principal = Principal(name=name, role=Role.AGENT, token_id="t")
        with _count_selects(engine) as selects, transaction(factory) as session:
            ack = heartbeat(session, principal, name, Heartbeat(jobs=reported), key_id=KEY_ID)
        return ack.stop_job_ids, len(selects)

    try:
        few = node_with(2, "few")
        many = node_with(7, "many")
        stop_few, queries_few = beat("few", *few[:3])
        stop_many, queries_many = beat("many", *many[:3])
        # The moved job and the finished one are stopped; the ones held here keep running.
        assert stop_few == sorted([few[1], few[2]])
        assert stop_many == sorted([many[1], many[2]])
        assert queries_many == queries_few
        with transaction(factory) as session:
            # The job held here that the agent no longer runs went back to the queue.
            for gone in (few[3], many[3]):
                job = session.get(Job, gone)
                assert job is not None and job.state == JobState.QUEUED.value
                assert session.scalar(select(GpuSlot).where(GpuSlot.job_id == gone)) is None
            kept = session.get(Job, many[0][0])
            assert kept is not None and kept.state == JobState.RUNNING.value
    finally:
        engine.dispose()
