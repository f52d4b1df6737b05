"""Placement of one plan slot onto nodes (pure function)."""

from __future__ import annotations

from scheduler_service.placement import NOWHERE, NodeSlots, Placement, place, place_jobs, place_plan

NODES = [NodeSlots(1, (0, 1, 2, 3)), NodeSlots(2, (0, 1, 2, 3, 4, 5, 6, 7))]
ALLOWED = {10: (1, 2, 4, 8), 11: (1, 2, 4, 8), 12: (1, 2, 4, 8)}


def test_a_running_job_keeps_its_slots_and_grows_in_place() -> None:
    current = {10: Placement(2, (0, 1))}
    out = place({10: 4}, current, NODES, ALLOWED, [10])
    assert out[10] == Placement(2, (0, 1, 2, 3))


def test_shrinking_frees_slots_before_others_are_placed() -> None:
    current = {10: Placement(1, (0, 1, 2, 3))}
    out = place({10: 1, 11: 3, 12: 8}, current, NODES, {**ALLOWED, 11: (3,)}, [12, 11, 10])
    assert out[10] == Placement(1, (0,))
    assert out[12] == Placement(2, tuple(range(8)))
    assert out[11] == Placement(1, (1, 2, 3))


def test_new_job_takes_the_best_fitting_node() -> None:
    out = place({11: 4}, {}, NODES, ALLOWED, [11])
    assert out[11] == Placement(1, (0, 1, 2, 3))


def test_paused_job_goes_back_to_its_home_node_when_it_fits() -> None:
    # Best fit alone would pick node 1 (4 free); home (node 2) holds its paused state.
    out = place({11: 4}, {}, NODES, ALLOWED, [11], home={11: 2})
    assert out[11] == Placement(2, (0, 1, 2, 3))


def test_paused_job_moves_when_its_home_is_full_or_gone() -> None:
    current = {10: Placement(1, (0, 1, 2, 3))}
    out = place({10: 4, 11: 4}, current, NODES, ALLOWED, [10, 11], home={11: 1})
    assert out[11].node_id == 2
    gone = place({11: 2}, {}, NODES, ALLOWED, [11], home={11: 99})
    assert gone[11] == Placement(1, (0, 1))


def test_a_count_that_fits_nowhere_is_lowered_or_dropped() -> None:
    out = place({11: 16}, {}, NODES, ALLOWED, [11])
    assert out[11] == Placement(2, tuple(range(8)))
    full = place({11: 8, 12: 8}, {}, [NodeSlots(1, tuple(range(8)))], ALLOWED, [11, 12])
    assert full[12] == NOWHERE


def test_a_lowered_count_comes_with_its_reason() -> None:
    placed = place_jobs({11: 16, 12: 8}, {}, NODES, ALLOWED, [11, 12])
    assert placed.placements[11] == Placement(2, tuple(range(8)))
    assert placed.short[11].startswith("16 GPUs asked, 8 placed: no ready node has 16 free")
    assert placed.placements[12] == Placement(1, (0, 1, 2, 3))
    assert "8 GPUs asked, 4 placed" in placed.short[12]
    assert 10 not in place_jobs({10: 4}, {}, NODES, ALLOWED, [10]).short


def test_spanning_nodes_keeps_tensor_parallel_groups_inside_a_node() -> None:
    # 12 GPUs: all 8 of node 2 and 4 of node 1, each part a multiple of TP 4.
    placed = place_jobs({11: 12}, {}, NODES, {11: (12,)}, [11], tp={11: 4}, span_nodes=True)
    assert placed.placements[11] == Placement(2, tuple(range(8)), ((1, (0, 1, 2, 3)),))
    assert placed.short == {}
    # Three free slots on a node hold no group of 4: 8 + 3 free give only 8.
    nodes = [NodeSlots(1, (0, 1, 2)), NodeSlots(2, tuple(range(8)))]
    short = place_jobs({11: 12}, {}, nodes, ALLOWED, [11], tp={11: 4}, span_nodes=True)
    assert short.placements[11] == Placement(2, tuple(range(8)))
    assert "tensor-parallel groups of 4" in short.short[11]


def test_a_spanning_job_grows_on_its_own_node_first_and_shrinks_off_the_others_first() -> None:
    current = {10: Placement(1, (0, 1))}
    grown = place_jobs({10: 8}, current, NODES, {10: (8,)}, [10], span_nodes=True)
    assert grown.placements[10] == Placement(1, (0, 1, 2, 3), ((2, (0, 1, 2, 3)),))
    back = place_jobs({10: 4}, grown.placements, NODES, {10: (4,)}, [10], span_nodes=True)
    assert back.placements[10] == Placement(1, (0, 1, 2, 3))


def test_a_plan_placed_slot_by_slot_runs_what_each_slot_holds() -> None:
    # Nodes of 4: job 1 holds 2 GPUs on node 1, job 2 holds 2 on node 2; job 3 asks for 4 in
    # both slots: first it gets 2 beside job 1 (best fit), then job 1 stops and it grows there.
    nodes = [NodeSlots(1, (0, 1, 2, 3)), NodeSlots(2, (0, 1, 2, 3))]
    current = {1: Placement(1, (0, 1)), 2: Placement(2, (0, 1))}
    gpus = {1: (2, 0), 2: (2, 2), 3: (4, 4)}
    allowed = {1: (1, 2), 2: (1, 2), 3: (1, 2, 4)}
    rows = place_plan(gpus, current, nodes, allowed, [1, 2, 3])
    assert rows == {1: (2, 0), 2: (2, 2), 3: (2, 4)}
    spanned = place_plan(gpus, current, nodes, allowed, [1, 2, 3], span_nodes=True)
    assert spanned == gpus


def test_making_room_keeps_tensor_parallel_groups_whole() -> None:
    # 3 GPUs are no whole number of 2-GPU tensor-parallel groups: no placement holds them, and
    # making room (found by tests/service/test_live_placement_properties.py) must not either.
    nodes = [NodeSlots(1, (0, 1, 2, 3))]
    placed = place_jobs(
        {7: 3}, {}, nodes, {7: (3,)}, [7], tp={7: 2}, span_nodes=True, move_jobs=True
    )
    assert placed.placements[7].gpus == 0 and 7 in placed.short
