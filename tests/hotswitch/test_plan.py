"""Planner properties (hypothesis) and hand-checked plans between real layouts."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_agent.hotswitch.plan import PlanError, build_plan, first_holder_max_send_bytes
from worker_agent.runtime.presets import JobSpec, build_job
from worker_agent.sharding import Holding, Layout, shard_map

Holdings = dict[int, list[Holding]]


@st.composite
def _side(draw: st.DrawFn, sizes: list[int], workers: list[int]) -> Holdings:
    """Each tensor cut into parts; each part held by 1..3 workers, at most one part per worker."""
    out: Holdings = {w: [] for w in workers}
    offsets = dict.fromkeys(workers, 0)
    for t, n in enumerate(sizes):
        n_parts = draw(st.integers(1, min(n, len(workers))))
        cuts = (
            sorted(draw(st.sets(st.integers(1, n - 1), min_size=n_parts - 1, max_size=n_parts - 1)))
            if n > 1
            else []
        )
        bounds = [0, *cuts, n]
        free = list(workers)
        for a, b in itertools.pairwise(bounds):
            k = draw(
                st.integers(1, max(1, min(3, len(free) - (len(bounds) - 2 - bounds.index(a)))))
            )
            holders = draw(st.permutations(free))[:k]
            for w in holders:
                free.remove(w)
                out[w].append(Holding(f"t{t}", a, b, offsets[w]))
                offsets[w] += b - a
    return out


@st.composite
def _problem(draw: st.DrawFn) -> tuple[Holdings, Holdings, dict[int, str]]:
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    n_src = draw(st.integers(1, 5))
    n_dst = draw(st.integers(1, 5))
    first_new = draw(st.integers(0, n_src))  # targets reuse some source workers, add new ones
    src_workers = list(range(n_src))
    dst_workers = list(range(first_new, first_new + n_dst))
    src = draw(_side(sizes, src_workers))
    dst = draw(_side(sizes, dst_workers))
    nodes = {w: draw(st.sampled_from(["a", "b"])) for w in set(src_workers) | set(dst_workers)}
    return src, dst, nodes


def _elements(hs: list[Holding]) -> set[tuple[str, int]]:
    return {(h.tensor, i) for h in hs for i in range(h.start, h.end)}


@settings(max_examples=300, deadline=None)
@given(_problem())
def test_every_needed_element_arrives_exactly_once_from_a_holder(
    problem: tuple[Holdings, Holdings, dict[int, str]],
) -> None:
    src, dst, nodes = problem
    plan = build_plan(src, dst, nodes)
    for w, needs in dst.items():
        got: list[tuple[str, int]] = []
        for c in plan.local_copies:
            if c.worker == w:
                got += [(c.tensor, i) for i in range(c.start, c.end)]
        received = [
            (t.tensor, i) for t in plan.transfers if t.dst == w for i in range(t.start, t.end)
        ]
        assert len(got) + len(received) == len(set(got) | set(received)), "an element came twice"
        assert set(got) | set(received) == _elements(needs)
        # Nothing is received that the worker already held.
        assert not set(received) & _elements(src.get(w, []))
    for t in plan.transfers:
        assert t.src != t.dst
        assert (t.tensor, t.start) in _elements(src[t.src])
        assert (t.tensor, t.end - 1) in _elements(src[t.src])


@settings(max_examples=300, deadline=None)
@given(_problem())
def test_offsets_move_the_right_values(problem: tuple[Holdings, Holdings, dict[int, str]]) -> None:
    """Simulate the plan on buffers filled with (tensor, index) labels."""
    src, dst, nodes = problem
    plan = build_plan(src, dst, nodes)
    old: dict[int, dict[int, tuple[str, int]]] = defaultdict(dict)
    for w, hs in src.items():
        for h in hs:
            for i in range(h.numel):
                old[w][h.offset + i] = (h.tensor, h.start + i)
    new: dict[int, dict[int, tuple[str, int]]] = defaultdict(dict)
    for c in plan.local_copies:
        for i in range(c.numel):
            new[c.worker][c.dst_offset + i] = old[c.worker][c.src_offset + i]
    for t in plan.transfers:
        for i in range(t.numel):
            new[t.dst][t.dst_offset + i] = old[t.src][t.src_offset + i]
    for w, hs in dst.items():
        for h in hs:
            for i in range(h.numel):
                assert new[w][h.offset + i] == (h.tensor, h.start + i)


@settings(max_examples=300, deadline=None)
@given(_problem())
def test_volume_is_the_lower_bound_and_balance_beats_first_holder(
    problem: tuple[Holdings, Holdings, dict[int, str]],
) -> None:
    src, dst, nodes = problem
    plan = build_plan(src, dst, nodes)
    missing = sum(len(_elements(dst[w]) - _elements(src.get(w, []))) for w in dst)
    assert plan.bytes_moved == plan.bytes_lower_bound == missing * 4
    assert plan.max_send_bytes <= first_holder_max_send_bytes(src, dst, nodes)
    assert sum(plan.send_bytes.values()) == plan.bytes_moved


@settings(max_examples=200, deadline=None)
@given(_problem())
def test_same_node_sender_is_preferred(problem: tuple[Holdings, Holdings, dict[int, str]]) -> None:
    src, dst, nodes = problem
    plan = build_plan(src, dst, nodes)
    for t in plan.transfers:
        holders = [
            w for w, hs in src.items() if w != t.dst and {(t.tensor, t.start)} <= _elements(hs)
        ]
        if any(nodes[w] == nodes[t.dst] for w in holders):
            assert nodes[t.src] == nodes[t.dst]


@settings(max_examples=200, deadline=None)
@given(_problem())
def test_cross_node_bytes_are_the_least_any_sender_choice_moves(
    problem: tuple[Holdings, Holdings, dict[int, str]],
) -> None:
    src, dst, nodes = problem
    plan = build_plan(src, dst, nodes)
    # Counted element by element: a needed element crosses nodes only when no worker on the
    # receiver's node holds it.
    near = {
        n: set().union(*(_elements(hs) for w, hs in src.items() if nodes[w] == n)) for n in "ab"
    }
    least = sum(len(_elements(dst[w]) - _elements(src.get(w, [])) - near[nodes[w]]) for w in dst)
    assert plan.bytes_cross_node == plan.bytes_cross_node_min == least * 4
    crossing = sum(t.numel for t in plan.transfers if nodes[t.src] != nodes[t.dst])
    assert plan.bytes_cross_node == crossing * 4
    assert build_plan(src, dst).bytes_cross_node == 0  # no node information: one node


def test_missing_state_raises_plan_error() -> None:
    src = {0: [Holding("w", 0, 4, 0)]}
    dst = {1: [Holding("w", 0, 8, 0)]}
    with pytest.raises(PlanError, match="no worker holds w"):
        build_plan(src, dst)


def test_greedy_balances_replicated_sources() -> None:
    # Two replicas of 4 tensors; a new worker needs all of them: each replica sends half.
    src = {w: [Holding(f"t{i}", 0, 10, 10 * i) for i in range(4)] for w in (0, 1)}
    dst = {2: [Holding(f"t{i}", 0, 10, 10 * i) for i in range(4)]}
    plan = build_plan(src, dst)
    assert plan.send_bytes == {0: 80, 1: 80}
    assert first_holder_max_send_bytes(src, dst) == 160


def _layout_holdings(layout: Layout, workers: list[int]) -> Holdings:
    job = build_job(JobSpec())
    return {
        w: shard_map(job.param_specs(), job.n_blocks(), layout, r).holdings()
        for r, w in enumerate(workers)
    }


def test_dp_to_tp_on_the_same_workers_moves_nothing() -> None:
    plan = build_plan(
        _layout_holdings(Layout(dp=2), [0, 1]), _layout_holdings(Layout(tp=2), [0, 1])
    )
    assert plan.bytes_moved == 0
    assert plan.local_copies


def test_tp_to_dp_moves_the_other_half_of_split_tensors() -> None:
    src = _layout_holdings(Layout(tp=2), [0, 1])
    plan = build_plan(src, _layout_holdings(Layout(dp=2), [0, 1]))
    job = build_job(JobSpec())
    split = sum(p.numel for p in job.param_specs() if p.kind == "split0")
    # Each worker receives the half of every split tensor (and its two Adam moments) it lacks.
    assert plan.bytes_moved == 2 * 3 * (split // 2) * 4
    assert plan.send_bytes[0] == plan.send_bytes[1]


def test_growing_dp_sends_whole_contiguous_shards() -> None:
    src = _layout_holdings(Layout(dp=2), [0, 1])
    plan = build_plan(src, _layout_holdings(Layout(dp=4), [0, 1, 2, 3]))
    state_bytes = sum(h.numel for h in src[0]) * 4
    assert plan.bytes_moved == 2 * state_bytes
    # New replicas are fed by different senders, and each message is one contiguous run.
    assert {t.src for t in plan.transfers} == {0, 1}
