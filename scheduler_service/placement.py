"""Place one slot of a plan onto nodes: keep jobs where they are, one node per job, fewest moves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSlots:
    """A ready node and the indices of its GPU slots."""

    node_id: int
    slot_indices: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Where a job runs: a node and slot indices (empty = not running)."""

    node_id: int | None
    slot_indices: tuple[int, ...]

    @property
    def gpus(self) -> int:
        """Number of GPUs placed."""
        return len(self.slot_indices)


NOWHERE = Placement(None, ())


def place(
    targets: Mapping[int, int],
    current: Mapping[int, Placement],
    nodes: Sequence[NodeSlots],
    allowed: Mapping[int, Sequence[int]],
    order: Sequence[int],
    home: Mapping[int, int] | None = None,
) -> dict[int, Placement]:
    """Placement for every job in `targets` (GPU counts), honouring `order` (most important first).

    A job keeps its node and the slots it holds whenever its node can host the new count; it
    moves only when its node cannot; a count that fits nowhere is lowered to the largest allowed
    count that fits (possibly 0). A job without slots goes back to its `home` node (where its
    paused state lives in the agent's memory) when that node has room for it.
    """
    free: dict[int, list[int]] = {n.node_id: sorted(n.slot_indices) for n in nodes}
    node_ids = set(free)
    held: dict[int, Placement] = {}
    # Slots held by jobs that keep running on a ready node are not free.
    for job_id, existing in current.items():
        if existing.node_id in node_ids and job_id in targets:
            held[job_id] = existing
            for index in existing.slot_indices:
                if index in free[existing.node_id]:
                    free[existing.node_id].remove(index)
    result: dict[int, Placement] = {}
    # Shrinking and stopping first, so their slots are free for the others.
    for job_id in order:
        kept = held.get(job_id)
        target = targets.get(job_id, 0)
        if kept is None or target > kept.gpus:
            continue
        keep = kept.slot_indices[:target]
        assert kept.node_id is not None
        free[kept.node_id].extend(i for i in kept.slot_indices if i not in keep)
        free[kept.node_id].sort()
        result[job_id] = Placement(kept.node_id, keep) if target else NOWHERE
    for job_id in order:
        if job_id in result:
            continue
        target = targets.get(job_id, 0)
        placement = held.get(job_id)
        node_id = placement.node_id if placement is not None else None
        if placement is not None and node_id is not None:
            extra = target - placement.gpus
            spare = free[node_id]
            if extra <= len(spare):
                added = tuple(spare[:extra])
                del spare[:extra]
                result[job_id] = Placement(node_id, tuple(sorted(placement.slot_indices + added)))
                continue
            # Its node cannot grow it that far: grow as far as allowed there rather than move.
            fits_here = [
                g
                for g in allowed.get(job_id, ())
                if placement.gpus <= g <= placement.gpus + len(spare)
            ]
            grown = max(fits_here, default=placement.gpus)
            added = tuple(spare[: grown - placement.gpus])
            del spare[: grown - placement.gpus]
            result[job_id] = Placement(node_id, tuple(sorted(placement.slot_indices + added)))
            continue
        home_id = (home or {}).get(job_id)
        if home_id in free and 0 < target <= len(free[home_id]):
            taken = tuple(free[home_id][:target])
            del free[home_id][:target]
            result[job_id] = Placement(home_id, taken)
            continue
        result[job_id] = _place_new(job_id, target, free, allowed)
    return result


def _place_new(
    job_id: int, target: int, free: dict[int, list[int]], allowed: Mapping[int, Sequence[int]]
) -> Placement:
    counts = [g for g in allowed.get(job_id, (target,)) if 0 < g <= target] or (
        [target] if target else []
    )
    for count in sorted(counts, reverse=True):
        # Best fit: the node with the fewest free slots that still holds the job.
        fitting = [(len(slots), node_id) for node_id, slots in free.items() if len(slots) >= count]
        if fitting:
            _, node_id = min(fitting)
            taken = tuple(free[node_id][:count])
            del free[node_id][:count]
            return Placement(node_id, taken)
    return NOWHERE
