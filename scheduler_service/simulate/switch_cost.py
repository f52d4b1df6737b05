"""Progress a hot switch costs a data-parallel job, from the measured figures of docs/hotswitch.md.

A switch from one placement to another (GPUs per node) pauses the job for: the new process-group
generation (`regroup_s`), the start of any new workers (`start_s`), and the bytes the new workers
pull. Every new data-parallel worker needs a whole replica of the training state (fp32
parameters and two Adam moments: `state_bytes_per_param`); it pulls it inside its node where a
node holds one (a worker kept there, or the paused job's state in the node's agent), else across
the link of a node that does, as the switch planner chooses senders (same node first). Pulls
inside a node run in parallel at `intra_node_bytes_per_s` per node; bytes between nodes are
bound by the busiest link: the holders' links together, or one receiving node's own link.
Shrinking keeps replicas and moves nothing (the regroup only).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

# Parameters of the trace models (published sizes; "measured" where bench/hotswitch_models.py
# built the model here and counted them). deepspeech2's size in ElasticFlow's profiles is not
# published with them: it gets DEFAULT_PARAMS.
MODEL_PARAMS: dict[str, float] = {
    "resnet50": 25.6e6,  # torchvision, 1,000 classes
    "resnet50_cifar10": 23.5e6,  # 10 classes (measured: 23.5 M)
    "vgg16": 138.4e6,  # torchvision
    "inception3": 27.2e6,  # torchvision inception_v3
    "bert": 109.5e6,  # BERT-base (measured)
    "gpt2": 124.4e6,  # GPT-2 124M (measured)
}
# A model of unknown size: the middle of the measured range (10 M to 500 M).
DEFAULT_PARAMS = 100e6


@dataclass(frozen=True)
class SwitchCostModel:
    """The measured switch cost's constants (docs/allocation.md, "Switch cost in the replay")."""

    # fp32 parameters + two Adam moments: BERT-base dp1 -> dp2 moved 1,314.2 MB = 109.5 M x 12.
    state_bytes_per_param: float = 12.0
    # New process-group generation when the worker set changes: 0.05-0.1 s measured.
    regroup_s: float = 0.1
    # Starting new workers (spawn, import, join): ~2-3 s each measured, in parallel; counted whole
    # (on the measured CPU box it overlaps training but shares its cores).
    start_s: float = 2.5
    # Same-node pulls: the slowest large shared-memory case measured, 3,021.6 MB in 0.597 s.
    intra_node_bytes_per_s: float = 5e9
    # Between nodes: 0.88 of the link rate was measured (607.6 MB in 5.55 s on a 1 Gbit/s link);
    # the link is 10 Gbit/s, as the shaped test links (the ITP fabric is not published).
    inter_node_bytes_per_s: float = 0.88 * 10e9 / 8

    def label(self) -> str:
        """The model and its constants, for the replay's report."""
        return (
            f"measured: {self.regroup_s:g} s regroup + {self.start_s:g} s if workers start + "
            f"replicas of {self.state_bytes_per_param:g} B/param at "
            f"{self.intra_node_bytes_per_s / 1e9:g} GB/s in a node, "
            f"{self.inter_node_bytes_per_s / 1e9:g} GB/s per node link"
        )

    def stall_s(
        self,
        params: float,
        old: Mapping[int, int],
        new: Mapping[int, int],
        holders: Set[int],
    ) -> float:
        """Seconds of progress a switch from `old` to `new` (GPUs per node) costs a job of
        `params` parameters; `holders`: nodes holding its state before (where it ran, or where
        its paused state is). 0 when nothing changes."""
        old = {n: g for n, g in old.items() if g > 0}
        new = {n: g for n, g in new.items() if g > 0}
        if old == new or not new:
            return 0.0  # nothing changes, or the job pauses (no progress to lose)
        replica_b = params * self.state_bytes_per_param
        local_b: dict[int, float] = {}
        into_b: dict[int, float] = {}
        for node, count in new.items():
            fresh = count - min(count, old.get(node, 0))
            if not fresh:
                continue
            if node in holders:
                local_b[node] = fresh * replica_b
            else:
                into_b[node] = fresh * replica_b
        if not local_b and not into_b:
            return self.regroup_s
        cross_s = 0.0
        if into_b:
            senders = max(1, len(holders))
            cross_s = max(sum(into_b.values()) / senders, max(into_b.values()))
            cross_s /= self.inter_node_bytes_per_s
        intra_s = max(local_b.values(), default=0.0) / self.intra_node_bytes_per_s
        return self.regroup_s + self.start_s + intra_s + cross_s


def model_params(model_name: str) -> float:
    """Parameters of a trace model (`DEFAULT_PARAMS` when its size is not known)."""
    return MODEL_PARAMS.get(model_name.lower(), DEFAULT_PARAMS)
