"""One control-loop tick moves a running job to another node whole: the pause on its old node is
delivered and answered first, then, in the same tick's second delivery round, its start on the
new node (`ControlLoop.tick`), over HTTP to two agents (tests/support/fake_agent.py)."""

from __future__ import annotations

import asyncio

from sqlalchemy import select, update

from scheduler_service.control_loop import ControlLoop, TickReport
from scheduler_service.db.base import utcnow
from scheduler_service.db.models import Allocation, Job, JobEvent, Node
from scheduler_service.db.session import make_engine, make_session_factory, transaction
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.secrets import NodeSecrets
from tests.api.conftest import database_url, postgres_server  # noqa: F401
from tests.service.test_budget_watchdog import _config
from tests.service.test_placement_moves_live import _shared, _two_running_and_one_new
from tests.support.fake_agent import FakeAgent, serving


def test_a_moved_jobs_start_is_delivered_in_the_same_tick_once_its_pause_is_answered(
    database_url: str,  # noqa: F811 (fixture)
) -> None:
    # Nodes a and b (4 GPUs each); r runs on a's 0-1 (at step 40), s on b's 0-1, e (4 GPUs) is
    # queued. The static policy plans every job at its largest count (r 2, s 2, e 4): e fits on
    # no node as they sit, so r moves whole from a to b. a's agent takes 0.3 s to answer the
    # pause (it checkpoints r): the start on b must come after that answer, in the same tick.
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    secrets = NodeSecrets.generate()
    now = utcnow()
    a, b, r, s, e = _two_running_and_one_new(factory, secrets, now)
    with transaction(factory) as session:
        session.execute(update(Job).where(Job.id.in_([r, s])).values(max_gpus=2))
        session.execute(update(Job).where(Job.id == e).values(min_gpus=4, max_gpus=4))
    agent_a, agent_b = (
        FakeAgent("a", pause_delay_s=0.3, steps={r: 40}),
        FakeAgent("b", steps={r: 40}),
    )

    async def one_tick() -> TickReport:
        loop = ControlLoop(
            _shared(_config(limit_kg=1000.0)), factory, engine, policy="static",
            node_secrets=secrets,
        )  # fmt: skip
        try:
            return await loop.tick()
        finally:
            await loop.agents.aclose()

    try:
        with serving(agent_a), serving(agent_b):
            with transaction(factory) as session:
                for node_id, agent in ((a, agent_a), (b, agent_b)):
                    session.execute(
                        update(Node).where(Node.id == node_id).values(agent_url=agent.url)
                    )
            report = asyncio.run(one_tick())
        got_a = {(c.job_id, c.generation, c.gpus): c for c in agent_a.calls}
        got_b = {(c.job_id, c.generation, c.gpus): c for c in agent_b.calls}
        # a: r's pause and e's start on all four GPUs; b: r's start, nothing for s (unchanged).
        assert set(got_a) == {(r, 2, 0), (e, 1, 4)}
        assert set(got_b) == {(r, 3, 2)}
        # The start on b left the scheduler only once a had answered the pause.
        assert got_b[r, 3, 2].received_s >= got_a[r, 2, 0].answered_s
        assert (report.commands, report.acked, report.failed) == (3, 3, 0)
        with transaction(factory) as session:
            states = {j.id: j.state for j in session.scalars(select(Job))}
            assert states == dict.fromkeys((r, s, e), JobState.RUNNING.value)
            commands = {
                (c.job_id, c.generation): (c.node_id, c.gpus, c.status)
                for c in session.scalars(select(Allocation))
            }
            assert commands == {
                (r, 1): (a, 2, "acked"), (s, 1): (b, 2, "acked"),
                (r, 2): (a, 0, "acked"), (r, 3): (b, 2, "acked"), (e, 1): (a, 4, "acked"),
            }  # fmt: skip
            started = session.scalars(
                select(JobEvent).where(JobEvent.job_id == r, JobEvent.kind == "allocation")
            ).one()
            assert "at step 40, resumed from checkpoint at step40" in started.reason
    finally:
        engine.dispose()
