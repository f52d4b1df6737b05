"""Parallel layouts (dp, tp, pp), rank coordinates, and the layout chooser."""

from __future__ import annotations

from dataclasses import dataclass

from worker_agent.sharding import Layout, LayoutError


@dataclass(frozen=True)
class ModelShape:
    """What the chooser needs to know about a model (sizes in elements, not bytes)."""

    n_params: int
    n_blocks: int
    tp_divisor: int
    """Every tensor-parallel degree must divide this (e.g. gcd of heads and sharded rows)."""
    activation_elems_per_sample: int
    """Hidden-state elements per sample crossing a block boundary (seq_len x width)."""
    flops_per_sample: float
    global_batch_size: int
    micro_batch_size: int


@dataclass(frozen=True)
class ClusterModel:
    """Coarse speeds used to rank layouts; only the ratios matter."""

    flops_per_s: float = 50e12
    intra_node_bytes_per_s: float = 150e9
    inter_node_bytes_per_s: float = 12e9
    bytes_per_elem: int = 4
    state_bytes_per_param: int = 16
    """fp32 parameter, gradient and two Adam moments."""
    activation_overhead: float = 16.0
    """Saved activations per block as a multiple of the block's hidden state."""


def valid_layouts(model: ModelShape, gpus: int) -> list[Layout]:
    """Every layout of `gpus` workers the model's shapes and batch size allow."""
    out: list[Layout] = []
    for tp in range(1, gpus + 1):
        if gpus % tp or model.tp_divisor % tp:
            continue
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp or pp > model.n_blocks:
                continue
            dp = gpus // (tp * pp)
            per_dp = model.global_batch_size // dp
            if model.global_batch_size % dp or per_dp % model.micro_batch_size:
                continue
            out.append(Layout(dp=dp, tp=tp, pp=pp))
    return out


def estimate_memory_bytes(model: ModelShape, layout: Layout, cluster: ClusterModel) -> float:
    """Peak bytes per worker: sharded training state plus GPipe-held activations."""
    state = model.n_params * cluster.state_bytes_per_param / (layout.tp * layout.pp)
    blocks_per_stage = -(-model.n_blocks // layout.pp)
    n_micro = model.global_batch_size // layout.dp // model.micro_batch_size
    held_micro = n_micro if layout.pp > 1 else 1
    act = (
        held_micro
        * model.micro_batch_size
        * model.activation_elems_per_sample
        * blocks_per_stage
        * cluster.activation_overhead
        * cluster.bytes_per_elem
        / layout.tp
    )
    return state + act


def estimate_step_s(
    model: ModelShape, layout: Layout, cluster: ClusterModel, gpus_per_node: int
) -> float:
    """Coarse step time: compute / gpus, stretched by the pipeline bubble, plus communication."""
    compute = model.flops_per_sample * model.global_batch_size / cluster.flops_per_s
    compute /= layout.world_size
    n_micro = model.global_batch_size // layout.dp // model.micro_batch_size
    bubble = (layout.pp - 1) / (n_micro + layout.pp - 1) if layout.pp > 1 else 0.0
    compute /= 1.0 - bubble
    tp_bw = (
        cluster.intra_node_bytes_per_s
        if layout.tp <= gpus_per_node
        else cluster.inter_node_bytes_per_s
    )
    tp_bytes = 0.0
    if layout.tp > 1:
        # Four all-reduces of the hidden state per block (two forward, two backward).
        per_rank_samples = model.global_batch_size / layout.dp
        tp_bytes = (
            4
            * model.n_blocks
            / layout.pp
            * per_rank_samples
            * model.activation_elems_per_sample
            * cluster.bytes_per_elem
            * 2
            * (layout.tp - 1)
            / layout.tp
        )
    dp_bw = (
        cluster.intra_node_bytes_per_s
        if layout.world_size <= gpus_per_node
        else cluster.inter_node_bytes_per_s
    )
    dp_bytes = 0.0
    if layout.dp > 1:
        shard = model.n_params / (layout.tp * layout.pp) * cluster.bytes_per_elem
        dp_bytes = 2 * shard * (layout.dp - 1) / layout.dp
    return compute + tp_bytes / tp_bw + dp_bytes / dp_bw


def choose_layout(
    model: ModelShape,
    gpus: int,
    memory_per_gpu_bytes: float,
    gpus_per_node: int | None = None,
    cluster: ClusterModel | None = None,
) -> Layout:
    """The fastest layout of `gpus` workers that fits in memory; TP never spans nodes."""
    cluster = cluster or ClusterModel()
    per_node = gpus_per_node or gpus
    candidates = [
        lay
        for lay in valid_layouts(model, gpus)
        if lay.tp <= per_node and estimate_memory_bytes(model, lay, cluster) <= memory_per_gpu_bytes
    ]
    if not candidates:
        raise LayoutError(
            f"no layout of {gpus} GPUs fits {model.n_params:,} parameters in "
            f"{memory_per_gpu_bytes / 2**30:.1f} GiB per GPU; give the job more GPUs or memory"
        )
    # Ties go to more TP (inside a node), then less PP: fewer bubbles, smaller DP all-reduce.
    return min(
        candidates,
        key=lambda lay: (
            round(estimate_step_s(model, lay, cluster, per_node), 12),
            -lay.tp,
            lay.pp,
        ),
    )
