"""The live service's placement (`NodeFacts.place`, what `dispatch.decide` sends) over random
clusters and plans (hypothesis).

What the loop sends never asks for more than a node holds: every slot exists on a ready node and
goes to one job at most, every part of a job across nodes holds whole tensor-parallel groups, a
job spans only nodes that may be spanned, a running job keeps its slots unless moved whole to
another node (with the reason), and a count is lowered only with a reason. Admission's check (`NodeFacts.place_rows`, slot by slot) and the
loop's placement agree: placed slot after slot from where the previous slot left the jobs, the
loop places every job at the count the check counted for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.placement import NOWHERE, NodeFacts, NodeSlots, Placed, Placement


@dataclass
class Case:
    facts: NodeFacts
    rows: dict[int, tuple[int, ...]]  # the plan: GPUs per job and slot
    allowed: dict[int, tuple[int, ...]]
    order: list[int]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=5))
    nodes = tuple(NodeSlots(i + 1, tuple(range(k))) for i, k in enumerate(sizes))
    spannable = draw(st.frozensets(st.sampled_from([n.node_id for n in nodes])))
    free = {n.node_id: list(n.slot_indices) for n in nodes}
    jobs = list(range(100, 100 + draw(st.integers(0, 7))))
    slots = draw(st.integers(1, 4))
    current: dict[int, Placement] = {}
    homes: dict[int, int] = {}
    tp: dict[int, int] = {}
    rows: dict[int, tuple[int, ...]] = {}
    allowed: dict[int, tuple[int, ...]] = {}
    for job in jobs:
        degree = draw(st.sampled_from([1, 1, 2, 4]))
        if degree > 1:
            tp[job] = degree
        allowed[job] = tuple(sorted(draw(st.sets(st.integers(1, 16), min_size=1, max_size=6))))
        rows[job] = tuple(draw(st.lists(st.integers(0, 16), min_size=slots, max_size=slots)))
        where = draw(st.sampled_from(["queued", "paused", "running", "spanning"]))
        if where == "paused":
            homes[job] = draw(st.sampled_from([n.node_id for n in nodes]))
        elif where in ("running", "spanning"):
            # Running jobs hold whole TP groups on each node (as placement left them).
            parts = []
            for node_id in draw(st.permutations(list(free)))[: 3 if where == "spanning" else 1]:
                n = min(len(free[node_id]), draw(st.integers(1, 6)))
                n -= n % degree
                if n:
                    parts.append((node_id, tuple(free[node_id][:n])))
                    del free[node_id][:n]
            if parts:
                (node_id, held), *others = parts
                current[job] = Placement(node_id, held, tuple(others))
    facts = NodeFacts(nodes, spannable, current, tp, homes)
    return Case(facts, rows, allowed, list(draw(st.permutations(jobs))))


def _check_sendable(case: Case, facts: NodeFacts, targets: dict[int, int], placed: Placed) -> None:
    """What the loop would send for `targets` fits the cluster and keeps the layout's rules."""
    slots_of = {n.node_id: set(n.slot_indices) for n in facts.nodes}
    used: set[tuple[int, int]] = set()
    for job, target in targets.items():
        p = placed.placements[job]
        degree = facts.tp.get(job, 1)
        old = facts.current.get(job, NOWHERE)
        for node_id, slots in p.parts:
            assert node_id in slots_of and set(slots) <= slots_of[node_id], (job, p)
            assert not used & {(node_id, i) for i in slots}, (job, p)
            used |= {(node_id, i) for i in slots}
            if len(p.parts) > 1:
                # Tensor-parallel groups stay inside a node; spanning only where allowed.
                assert len(slots) % degree == 0, (job, p, degree)
                assert node_id in facts.spannable or node_id in {n for n, _ in old.parts}, (
                    job,
                    p,
                )
        assert p.gpus <= target
        assert (p.gpus < target) == (job in placed.short), (job, p, placed.short)
        if old.node_id is not None and target > 0:
            if job in placed.moved:
                # Moved off its node (inside one node, maybe after shrinking off the others): the
                # loop pauses it on its old node before it starts on the new one.
                assert p.node_id != old.node_id, (job, old, p)
            else:
                # Else it keeps its slots, grows around them or shrinks within them.
                before = {(n, i) for n, s in old.parts for i in s}
                after = {(n, i) for n, s in p.parts for i in s}
                assert before <= after or after <= before, (job, old, p)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_loop_sends_only_placements_the_cluster_holds_and_admission_counted(
    case: Case,
) -> None:
    counted = case.facts.place_rows(case.rows, case.allowed, case.order)
    facts = case.facts
    homes = dict(facts.homes)
    for t in range(len(next(iter(case.rows.values()), ()))):
        targets = {job: row[t] for job, row in case.rows.items()}
        placed = facts.place(targets, case.allowed, case.order)
        _check_sendable(case, facts, targets, placed)
        # The count admission's check counted for this slot is the count the loop places.
        assert {j: p.gpus for j, p in placed.placements.items()} == {
            j: counted[j][t] for j in targets
        }, t
        # The next tick: jobs where this one placed them; a job paused now has its home where
        # it ran (its agent holds the paused state).
        for job, p in placed.placements.items():
            if p.node_id is not None:
                homes[job] = p.node_id
        current = {j: p for j, p in placed.placements.items() if p.node_id is not None}
        facts = NodeFacts(
            facts.nodes,
            facts.spannable,
            current,
            facts.tp,
            {j: n for j, n in homes.items() if j not in current},
        )


@settings(max_examples=200, deadline=None)
@given(cases())
def test_every_move_says_from_where_to_where(case: Case) -> None:
    targets = {job: row[0] for job, row in case.rows.items()}
    placed = case.facts.place(targets, case.allowed, case.order)
    for job, why in placed.moved.items():
        to = placed.placements[job].node_id
        assert to is not None, (job, why)
        if job in case.facts.current:  # running: moved whole off its node
            # (A job across nodes that shrinks off its own node first moves from where it
            # shrank to: the reason names that node, the loop pauses it on its own.)
            at = case.facts.current[job].node_id
            assert to != at and f" to node {to}" in why and why.startswith("moved"), (job, why)
        else:  # paused: placed off the node that holds its paused state
            home = case.facts.homes[job]
            assert to != home and f"not on its home node {home}" in why, (job, why)
