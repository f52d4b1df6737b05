"""Placement keeps jobs where they are when the plan fits there (hypothesis, over random
clusters): a plan whose counts fit with every running job on its slots (growing on its own
node, or shrinking within them), every paused job on its home node and the new jobs in the GPUs
left moves nobody, whatever the order of the jobs; and where a move is needed, a job not yet
started moves before a paused one, and a paused one before a running one."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.placement import NodeFacts, NodeSlots, Placement, place_jobs


@dataclass
class Staying:
    facts: NodeFacts
    targets: dict[int, int]
    order: list[int]
    where: dict[int, int]  # job -> the node a placement that moves nobody puts it on
    kinds: dict[int, str]  # job -> running, paused or queued


@st.composite
def staying(draw: st.DrawFn) -> Staying:
    """Nodes, jobs holding slots on them, and counts that fit where the jobs are: running jobs
    shrink within their slots or grow on their own node, paused jobs go back to their home
    node, queued jobs fill GPUs left on some node. Every count is whole tensor-parallel groups.
    """
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
    nodes = tuple(NodeSlots(i + 1, tuple(range(k))) for i, k in enumerate(sizes))
    spannable = draw(st.frozensets(st.sampled_from([n.node_id for n in nodes])))
    free = {n.node_id: list(n.slot_indices) for n in nodes}
    jobs = list(range(100, 100 + draw(st.integers(1, 7))))
    kinds = {j: draw(st.sampled_from(["running", "paused", "queued"])) for j in jobs}
    tp = {j: draw(st.sampled_from([1, 1, 2])) for j in jobs}
    current: dict[int, Placement] = {}
    where: dict[int, int] = {}
    # The running jobs' slots first (as the last placement left them).
    for job in jobs:
        if kinds[job] != "running":
            continue
        node = draw(st.sampled_from(sorted(free)))
        have = min(len(free[node]), draw(st.integers(1, 6)))
        have -= have % tp[job]
        if not have:
            kinds[job] = "queued"
            continue
        current[job] = Placement(node, tuple(free[node][:have]))
        where[job] = node
        del free[node][:have]
    room = {n: len(s) for n, s in free.items()}
    targets: dict[int, int] = {}
    # Shrinks first: the GPUs they give back are room for the others.
    for job in jobs:
        if kinds[job] == "running" and draw(st.booleans()):
            have = current[job].gpus
            targets[job] = tp[job] * draw(st.integers(1, have // tp[job]))
            room[where[job]] += have - targets[job]
    homes: dict[int, int] = {}
    for job in jobs:
        if job in targets:
            continue
        if kinds[job] == "running":
            node = where[job]
            grow = tp[job] * draw(st.integers(0, room[node] // tp[job]))
            targets[job] = current[job].gpus + grow
            room[node] -= grow
            continue
        node = draw(st.sampled_from(sorted(room)))
        count = tp[job] * draw(st.integers(0, room[node] // tp[job]))
        if kinds[job] == "paused":
            homes[job] = node
        targets[job] = count
        room[node] -= count
        if count:
            where[job] = node
    facts = NodeFacts(nodes, spannable, current, {j: d for j, d in tp.items() if d > 1}, homes)
    return Staying(facts, targets, list(draw(st.permutations(jobs))), where, kinds)


@settings(max_examples=400, deadline=None)
@given(staying())
def test_a_plan_that_fits_where_jobs_are_moves_nobody(case: Staying) -> None:
    allowed = {j: tuple(range(1, 17)) for j in case.targets}
    # The live rule: every job may move (`LIVE_MOVABLE`, with shared checkpoints).
    placed = case.facts.place(case.targets, allowed, case.order)
    assert placed.moved == {}, placed
    assert placed.short == {}, placed
    for job, target in case.targets.items():
        p = placed.placements[job]
        assert p.gpus == target, (job, p)
        if case.kinds[job] == "running":
            before = set(case.facts.current[job].slot_indices)
            assert p.node_id == case.where[job] and not p.others, (job, p)
            assert before <= set(p.slot_indices) or set(p.slot_indices) <= before, (job, p)
        elif case.kinds[job] == "paused" and target:
            assert p.parts == ((case.where[job], p.slot_indices),), (job, p)


def test_a_new_job_leaves_a_running_jobs_room_to_grow_on_its_node() -> None:
    # Nodes 1 and 2 (4 GPUs each); x runs on node 1's 0-1 and is planned 4, y on node 2's 0-1
    # planned 2; q (new, placed first) is planned 2. Best fit alone put q on node 1 (2 free on
    # each; the lower id), so x could grow only by moving to node 2, and y moved to node 1.
    x, y, q = 1, 2, 3
    nodes = [NodeSlots(1, (0, 1, 2, 3)), NodeSlots(2, (0, 1, 2, 3))]
    current = {x: Placement(1, (0, 1)), y: Placement(2, (0, 1))}
    allowed = {j: (1, 2, 3, 4) for j in (x, y, q)}
    placed = place_jobs(
        {x: 4, y: 2, q: 2}, current, nodes, allowed, [q, x, y], span_nodes=True, move_jobs=True
    )
    assert placed.moved == {} and placed.short == {}
    assert placed.placements == {
        x: Placement(1, (0, 1, 2, 3)),
        y: Placement(2, (0, 1)),
        q: Placement(2, (2, 3)),
    }


def test_a_paused_job_is_placed_off_its_home_before_a_running_job_moves() -> None:
    # Node 1 (6 GPUs): r runs on 0-1, p is paused with its state on node 1 and goes back there
    # (2-3); node 2 (2 GPUs) is free. e (4 GPUs) fits only on node 1, once one of them leaves
    # for node 2: p (it resumes from a checkpoint), not r (a pause, a checkpoint and a
    # restart), whichever has the lower id.
    for r, p in ((10, 20), (20, 10)):
        e = 30
        nodes = [NodeSlots(1, tuple(range(6))), NodeSlots(2, (0, 1))]
        current = {r: Placement(1, (0, 1))}
        allowed = {j: (2, 4) for j in (r, p, e)}
        placed = place_jobs(
            {p: 2, r: 2, e: 4}, current, nodes, allowed, [p, r, e], home={p: 1},
            span_nodes=True, spannable=(), move_jobs=True,
        )  # fmt: skip
        assert set(placed.moved) == {p}, placed.moved
        assert placed.placements[r] == Placement(1, (0, 1))
        assert placed.placements[p] == Placement(2, (0, 1))
        assert placed.placements[e] == Placement(1, (2, 3, 4, 5))


def test_of_two_running_jobs_the_one_with_fewer_gpus_moves() -> None:
    # Node 1 (7 GPUs): a runs on 0-2 (3 GPUs), b on 3-4 (2 GPUs); node 2 (3 GPUs) free. e (4)
    # fits on node 1 once one of them leaves (no node may be spanned): both fit on node 2, b
    # moves fewer GPUs.
    a, b, e = 1, 2, 3
    nodes = [NodeSlots(1, tuple(range(7))), NodeSlots(2, (0, 1, 2))]
    current = {a: Placement(1, (0, 1, 2)), b: Placement(1, (3, 4))}
    allowed = {j: (1, 2, 3, 4) for j in (a, b, e)}
    placed = place_jobs(
        {a: 3, b: 2, e: 4}, current, nodes, allowed, [e, a, b], span_nodes=True, spannable=(),
        move_jobs=True,
    )  # fmt: skip
    assert set(placed.moved) == {b}, placed.moved
    assert placed.placements[e].gpus == 4 and placed.placements[e].node_id == 1
