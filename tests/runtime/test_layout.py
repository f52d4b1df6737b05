"""Layouts, the layout chooser and shard geometry (no processes)."""

from __future__ import annotations

import pytest

from worker_agent.runtime.errors import LayoutError
from worker_agent.runtime.layout import (
    ClusterModel,
    ModelShape,
    choose_layout,
    estimate_memory_bytes,
    valid_layouts,
)
from worker_agent.runtime.presets import JobSpec, build_job, model_shape
from worker_agent.sharding import Layout, shard_map, split_blocks


def test_coords_round_trip_and_groups_partition_ranks() -> None:
    lay = Layout(dp=2, tp=2, pp=3)
    assert lay.world_size == 12
    for r in range(12):
        c = lay.coords(r)
        assert lay.rank_of(c.pp, c.dp, c.tp) == r
    for groups in (lay.tp_groups(), lay.dp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(12))
    # TP groups are runs of consecutive ranks (one node when ranks fill nodes in order).
    assert lay.tp_groups()[0] == [0, 1]
    with pytest.raises(LayoutError):
        lay.coords(12)
    with pytest.raises(LayoutError):
        Layout(dp=0)


def test_split_blocks_is_contiguous_and_balanced() -> None:
    assert split_blocks(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(LayoutError, match="exceeds"):
        split_blocks(2, 3)


def _shape(**kw: int) -> ModelShape:
    spec = JobSpec.model_validate(kw)
    return model_shape(build_job(spec), spec)


def test_valid_layouts_respect_heads_blocks_and_batch() -> None:
    shape = _shape(n_layers=2, n_heads=2, global_batch_size=8, micro_batch_size=2)
    lays = valid_layouts(shape, 8)
    assert Layout(dp=4, tp=2, pp=1) in lays
    assert all(lay.tp <= 2 and lay.pp <= 2 and lay.world_size == 8 for lay in lays)
    assert Layout(dp=8) not in lays  # 8 samples / 8 replicas < micro-batch of 2


def test_choose_layout_keeps_tp_inside_a_node_and_fits_memory() -> None:
    shape = _shape(
        n_layers=8,
        d_model=1024,
        n_heads=16,
        seq_len=512,
        vocab_size=32000,
        global_batch_size=64,
        micro_batch_size=4,
    )
    lay = choose_layout(shape, 8, memory_per_gpu_bytes=80 * 2**30, gpus_per_node=4)
    assert lay.tp <= 4
    assert estimate_memory_bytes(shape, lay, ClusterModel()) <= 80 * 2**30
    # With little memory the chooser must shard the state (tp or pp > 1).
    tight = estimate_memory_bytes(shape, Layout(dp=8), ClusterModel()) * 0.6
    small = choose_layout(shape, 8, memory_per_gpu_bytes=tight, gpus_per_node=8)
    assert small.tp * small.pp > 1
    with pytest.raises(LayoutError, match="no layout"):
        choose_layout(shape, 8, memory_per_gpu_bytes=1e6)


def test_shards_of_split_tensors_tile_the_logical_tensor() -> None:
    job = build_job(JobSpec(n_layers=3))
    specs, n = job.param_specs(), job.n_blocks()
    lay = Layout(dp=2, tp=2, pp=2)
    covered: dict[str, set[int]] = {}
    for r in range(lay.world_size):
        if lay.coords(r).dp != 0:
            continue
        for ps in shard_map(specs, n, lay, r).params:
            got = covered.setdefault(ps.spec.name, set())
            if ps.spec.kind == "split0":
                assert not got & set(range(ps.start, ps.end))
            got |= set(range(ps.start, ps.end))
    assert {p.name for p in specs} == set(covered)
    for p in specs:
        assert covered[p.name] == set(range(p.numel))


def test_flat_buffer_holds_params_then_two_moments() -> None:
    job = build_job(JobSpec())
    smap = shard_map(job.param_specs(), job.n_blocks(), Layout(tp=2), 1)
    hs = smap.holdings()
    assert smap.n_state_elems == 3 * smap.n_param_elems
    assert sorted(h.offset for h in hs)[0] == 0
    assert max(h.offset + h.numel for h in hs) == smap.n_state_elems
