"""The measured switch cost model (`simulate/switch_cost.py`), hand-computed."""

from __future__ import annotations

import pytest

from scheduler_service.simulate.switch_cost import DEFAULT_PARAMS, SwitchCostModel, model_params

MODEL = SwitchCostModel()
GPT2 = model_params("gpt2")  # 124.4 M parameters: 1.4928 GB of state a replica
REPLICA_B = GPT2 * 12.0
FIXED_S = 0.1 + 2.5  # regroup + new workers start


def test_nothing_changes_or_a_pause_costs_nothing_and_a_shrink_only_the_regroup() -> None:
    assert MODEL.stall_s(GPT2, {0: 4}, {0: 4}, {0}) == 0.0
    assert MODEL.stall_s(GPT2, {0: 4}, {}, {0}) == 0.0
    # Shrinking keeps a replica on every kept worker: nothing moves, the group is formed anew.
    assert MODEL.stall_s(GPT2, {0: 4, 1: 4}, {0: 2}, {0, 1}) == pytest.approx(0.1)


def test_growing_inside_a_node_pulls_a_replica_for_each_new_worker_there() -> None:
    # 1 -> 8 on node 0: 7 new workers, each 1.4928 GB at 5 GB/s (same node).
    assert MODEL.stall_s(GPT2, {0: 1}, {0: 8}, {0}) == pytest.approx(FIXED_S + 7 * REPLICA_B / 5e9)


def test_growing_onto_a_node_without_a_replica_crosses_its_link() -> None:
    # 8 on node 0 -> 8 + 8: node 1's 8 new workers pull across at 0.88 x 10 Gbit/s.
    link_bps = 0.88 * 10e9 / 8
    assert MODEL.stall_s(GPT2, {0: 8}, {0: 8, 1: 8}, {0}) == pytest.approx(
        FIXED_S + 8 * REPLICA_B / link_bps
    )
    # Held on two nodes, the senders' two links share the bytes, but node 2's own link bounds them.
    two = MODEL.stall_s(GPT2, {0: 4, 1: 4}, {0: 4, 1: 4, 2: 4}, {0, 1})
    assert two == pytest.approx(FIXED_S + 4 * REPLICA_B / link_bps)
    # A whole job moved to another node: every worker is new there and crosses.
    assert MODEL.stall_s(GPT2, {0: 2}, {1: 2}, {0}) == pytest.approx(
        FIXED_S + 2 * REPLICA_B / link_bps
    )


def test_a_paused_job_resumes_from_its_agent_inside_its_home_node() -> None:
    assert MODEL.stall_s(GPT2, {}, {3: 2}, {3}) == pytest.approx(FIXED_S + 2 * REPLICA_B / 5e9)
    assert MODEL.stall_s(GPT2, {}, {4: 2}, {3}) > MODEL.stall_s(GPT2, {}, {3: 2}, {3})


def test_unknown_models_get_the_default_size_and_the_label_names_the_constants() -> None:
    assert model_params("deepspeech2") == DEFAULT_PARAMS
    assert model_params("ResNet50") == 25.6e6
    assert MODEL.label().startswith("measured: 0.1 s regroup + 2.5 s if workers start")
