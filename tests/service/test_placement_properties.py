"""Placement properties over random clusters and plans (hypothesis).

No placement exceeds any node: every slot it names exists on a ready node and is given to one
job at most. No count is lowered silently: a job gets at most its target, and fewer only with a
reason. Running jobs keep their slots (they grow around them or shrink within them). Parts on
several nodes hold whole tensor-parallel groups, and a job only spans onto nodes that may be
spanned (their agents reach each other).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from random import Random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler_service.placement import (
    MOVE_MOST_JOBS,
    NOWHERE,
    NodeSlots,
    Placement,
    place_jobs,
    place_plan,
)


@dataclass
class Case:
    nodes: list[NodeSlots]
    targets: dict[int, int]
    current: dict[int, Placement]
    allowed: dict[int, tuple[int, ...]]
    tp: dict[int, int]
    order: list[int]
    span_nodes: bool
    spannable: set[int] | None = None


@st.composite
def cases(draw: st.DrawFn) -> Case:
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=5))
    nodes = [NodeSlots(i + 1, tuple(range(k))) for i, k in enumerate(sizes)]
    span_nodes = draw(st.booleans())
    free = {n.node_id: list(n.slot_indices) for n in nodes}
    jobs = list(range(100, 100 + draw(st.integers(0, 6))))
    targets: dict[int, int] = {}
    current: dict[int, Placement] = {}
    allowed: dict[int, tuple[int, ...]] = {}
    tp: dict[int, int] = {}
    for job in jobs:
        t = draw(st.sampled_from([1, 2, 4])) if span_nodes else 1
        tp[job] = t
        targets[job] = draw(st.integers(0, 12))
        allowed[job] = tuple(sorted(draw(st.sets(st.integers(1, 12), max_size=6))))
        where = draw(st.sampled_from(["none", "here", "lost"]))
        if where == "lost":  # placed on a node that is no longer ready
            current[job] = Placement(99, (0,))
        elif where == "here":
            parts = []
            for node_id in draw(st.permutations(list(free)))[: 3 if span_nodes else 1]:
                n = min(len(free[node_id]), draw(st.integers(1, 4)))
                n -= n % t
                if n:
                    parts.append((node_id, tuple(free[node_id][:n])))
                    del free[node_id][:n]
            if parts:
                (node_id, slots), *others = parts
                current[job] = Placement(node_id, slots, tuple(others))
    order = draw(st.permutations(jobs))
    spannable = draw(st.none() | st.sets(st.sampled_from([n.node_id for n in nodes])))
    return Case(nodes, targets, current, allowed, tp, list(order), span_nodes, spannable)


@settings(max_examples=400, deadline=None)
@given(cases(), st.booleans())
@example(
    # Job 100 spans nodes 1-3, shrinks to 1 GPU on node 1 and is moved whole to node 2 to make
    # room for job 102's 2 GPUs (found by a random run).
    Case(
        nodes=[NodeSlots(1, (0, 1)), NodeSlots(2, (0,)), NodeSlots(3, (0,)), NodeSlots(4, (0,))],
        targets={100: 1, 101: 0, 102: 2, 103: 0},
        current={100: Placement(1, (0,), ((2, (0,)), (3, (0,))))},
        allowed={100: (), 101: (), 102: (1,), 103: ()},
        tp={100: 1, 101: 1, 102: 1, 103: 1},
        order=[100, 101, 102, 103],
        span_nodes=True,
        spannable=None,
    ),
    True,
)
def test_no_placement_exceeds_a_node_and_nothing_is_lowered_silently(
    case: Case, moves: bool
) -> None:
    placed = place_jobs(
        case.targets,
        case.current,
        case.nodes,
        case.allowed,
        case.order,
        tp=case.tp,
        span_nodes=case.span_nodes,
        spannable=case.spannable,
        move_jobs=moves,
    )
    assert moves or not placed.moved
    slots_of = {n.node_id: set(n.slot_indices) for n in case.nodes}
    used: set[tuple[int, int]] = set()
    for job, target in case.targets.items():
        p = placed.placements[job]
        for node_id, slots in p.parts:
            assert node_id in slots_of, (job, p)
            assert set(slots) <= slots_of[node_id], (job, p)
            for index in slots:
                assert (node_id, index) not in used, (job, p)
                used.add((node_id, index))
            if len(p.parts) > 1:
                assert len(slots) % case.tp[job] == 0, (job, p)
                old_parts = case.current[job].parts if job in case.current else ()
                # A node the job did not span before is one that may be spanned.
                assert (
                    case.spannable is None
                    or node_id in case.spannable
                    or node_id in {n for n, _ in old_parts}
                ), (job, p, case.spannable)
        if not case.span_nodes:
            assert len(p.parts) <= 1
        assert p.gpus <= target
        assert (p.gpus < target) == (job in placed.short), (job, p, placed.short)
        old = case.current.get(job)
        if job in placed.moved:
            # Moved whole to one node, on another node. Inside one node as it sat when moved:
            # a job across nodes that shrank onto its own node in the same pass may move too.
            assert old is not None and not p.others, (job, old, p)
            assert p.node_id != old.node_id, (job, old, p)
            assert not old.others or p.gpus <= len(old.slot_indices), (job, old, p)
        elif old is not None and old.node_id in slots_of and target > 0:
            before = {(n, i) for n, s in old.parts for i in s}
            after = {(n, i) for n, s in p.parts for i in s}
            assert before <= after or after <= before, (job, old, p)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 8), min_size=1, max_size=5),
    st.lists(st.integers(1, 12), max_size=6),
)
def test_spanning_nodes_places_every_count_the_pooled_capacity_holds(
    sizes: list[int], wanted: list[int]
) -> None:
    nodes = [NodeSlots(i + 1, tuple(range(k))) for i, k in enumerate(sizes)]
    total = sum(sizes)
    targets: dict[int, int] = {}
    for job, want in enumerate(wanted):
        if sum(targets.values()) + want <= total:
            targets[job] = want
    allowed = {job: tuple(range(1, 13)) for job in targets}
    placed = place_jobs(targets, {}, nodes, allowed, list(targets), span_nodes=True)
    assert {job: p.gpus for job, p in placed.placements.items()} == targets
    assert placed.short == {}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 8), min_size=1, max_size=4),
    st.lists(st.lists(st.integers(0, 12), min_size=4, max_size=4), min_size=1, max_size=6),
)
def test_plan_after_plan_spanning_places_every_count_the_pooled_capacity_holds(
    sizes: list[int], plans: list[list[int]]
) -> None:
    # What the node-aware simulator relies on for data-parallel jobs: placing each plan where
    # the last one left the jobs (they keep their slots, paused ones go home) never lowers a
    # count the pooled capacity holds, so its figures equal the pooled ones.
    nodes = [NodeSlots(i + 1, tuple(range(k))) for i, k in enumerate(sizes)]
    current: dict[int, Placement] = {}
    homes: dict[int, int] = {}
    for wanted in plans:
        targets: dict[int, int] = {}
        for job, want in enumerate(wanted):
            targets[job] = want if sum(targets.values()) + want <= sum(sizes) else 0
        allowed = {job: tuple(range(1, 13)) for job in targets}
        placed = place_jobs(
            targets, current, nodes, allowed, list(targets), home=homes, span_nodes=True
        )
        assert {job: p.gpus for job, p in placed.placements.items()} == targets
        assert placed.short == {}
        current = placed.placements
        homes |= {job: p.node_id for job, p in current.items() if p.node_id is not None}


def test_a_job_spans_only_nodes_that_may_be_spanned_and_else_takes_the_largest_node() -> None:
    nodes = [NodeSlots(1, tuple(range(6))), NodeSlots(2, (0, 1)), NodeSlots(3, (0, 1))]
    allowed = {7: tuple(range(1, 9))}
    # Nodes 2 and 3 reach each other, node 1 does not: 4 GPUs spanned < 6 on node 1 alone.
    placed = place_jobs({7: 8}, {}, nodes, allowed, [7], span_nodes=True, spannable={2, 3})
    assert placed.placements[7] == Placement(1, tuple(range(6)))
    assert "6 placed" in placed.short[7]
    # All three may be spanned: the whole 8, node 1 first (the most free).
    placed = place_jobs({7: 8}, {}, nodes, allowed, [7], span_nodes=True)
    assert placed.placements[7] == Placement(1, tuple(range(6)), ((2, (0, 1)),))
    assert placed.short == {}


@settings(max_examples=200, deadline=None)
@given(cases(), st.lists(st.integers(1, 4), min_size=1, max_size=6), st.randoms())
def test_placing_a_plan_equals_placing_each_slot_in_turn(
    case: Case, runs: list[int], rnd: Random
) -> None:
    # `place_plan` skips slots whose placement settled; it must give what a slot-by-slot loop
    # gives. The plan: runs of equal slots (lengths `runs`), each of counts the jobs allow.
    gpus: dict[int, list[int]] = {j: [] for j in case.targets}
    for length in runs:
        for j, row in gpus.items():
            row.extend([rnd.choice([0, *case.allowed[j]])] * length)
    plan = {j: tuple(row) for j, row in gpus.items()}
    args = (case.allowed, case.order, None, case.tp, case.span_nodes, case.spannable)
    current: dict[int, Placement] = dict(case.current)
    homes: dict[int, int] = {}
    expected: dict[int, list[int]] = {j: [] for j in plan}
    for t in range(max((len(r) for r in plan.values()), default=0)):
        current = place_jobs(
            {j: r[t] for j, r in plan.items()},
            current,
            case.nodes,
            case.allowed,
            case.order,
            homes,
            case.tp,
            case.span_nodes,
            case.spannable,
        ).placements
        for j, row in expected.items():
            where = current.get(j, NOWHERE)
            row.append(where.gpus)
            if where.node_id is not None:
                homes[j] = where.node_id
    assert place_plan(plan, case.current, case.nodes, *args) == {
        j: tuple(r) for j, r in expected.items()
    }


@dataclass
class Fragmented:
    nodes: list[NodeSlots]
    others: dict[int, Placement]  # jobs inside one node that keep their counts
    mine: Placement  # the most important job (0) now: on one node, or not running
    target: int


@st.composite
def fragmented(draw: st.DrawFn) -> Fragmented:
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
    nodes = [NodeSlots(i + 1, tuple(range(k))) for i, k in enumerate(sizes)]
    free = {n.node_id: list(n.slot_indices) for n in nodes}
    others: dict[int, Placement] = {}
    for job in range(1, 1 + draw(st.integers(0, MOVE_MOST_JOBS))):
        node = draw(st.sampled_from(sorted(free)))
        n = min(len(free[node]), draw(st.integers(1, 4)))
        if n:
            others[job] = Placement(node, tuple(free[node][:n]))
            del free[node][:n]
    target = draw(st.integers(1, max(sizes)))
    mine = NOWHERE
    node = draw(st.sampled_from(sorted(free)))
    have = min(len(free[node]), draw(st.integers(0, target - 1)))
    if have:
        mine = Placement(node, tuple(free[node][:have]))
    return Fragmented(nodes, others, mine, target)


def _fewest_moves(case: Fragmented) -> int | None:
    """By brute force: the fewest running jobs moved (whole, at their counts; job 0 too where it
    runs and leaves its node) in any placement that holds job 0's target on one node; None where
    none does."""
    cap = {n.node_id: len(n.slot_indices) for n in case.nodes}
    jobs = sorted(case.others)
    best: int | None = None
    for node in cap:
        for where in product(cap, repeat=len(jobs)):
            load = dict.fromkeys(cap, 0)
            load[node] += case.target
            for job, at in zip(jobs, where, strict=True):
                load[at] += case.others[job].gpus
            if all(load[n] <= cap[n] for n in cap):
                moved = sum(at != case.others[j].node_id for j, at in zip(jobs, where, strict=True))
                moved += case.mine.node_id not in (None, node)
                best = moved if best is None else min(best, moved)
    return best


@settings(max_examples=300, deadline=None)
@given(fragmented())
def test_moving_jobs_keeps_a_promised_count_wherever_a_placement_holds_it(
    case: Fragmented,
) -> None:
    targets = {0: case.target} | {j: p.gpus for j, p in case.others.items()}
    current = {j: p for j, p in case.others.items()}
    if case.mine.node_id is not None:
        current[0] = case.mine
    allowed = {j: tuple(range(1, 9)) for j in targets}
    placed = place_jobs(targets, current, case.nodes, allowed, list(targets), move_jobs=True)
    slots_of = {n.node_id: set(n.slot_indices) for n in case.nodes}
    used: set[tuple[int, int]] = set()
    for job, p in placed.placements.items():
        assert len(p.parts) <= 1, (job, p)
        for node_id, slots in p.parts:
            assert set(slots) <= slots_of[node_id], (job, p)
            assert not used & {(node_id, i) for i in slots}, (job, p)
            used |= {(node_id, i) for i in slots}
    # The other jobs keep their counts, where they are unless moved.
    for job, old in case.others.items():
        assert placed.placements[job].gpus == old.gpus
        assert (placed.placements[job] != old) == (job in placed.moved), (job, old)
    fewest = _fewest_moves(case)
    if fewest is None:
        assert placed.placements[0].gpus < case.target and 0 in placed.short
        assert not placed.moved
    else:
        assert placed.placements[0].gpus == case.target and 0 not in placed.short
        assert len(placed.moved) == fewest, (placed.moved, fewest)
