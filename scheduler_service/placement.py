"""Place one slot of a plan onto nodes: keep jobs where they are, fewest moves, never lower silently.

A job's tensor-parallel groups stay inside a node: every node's part of a job holds whole TP
groups (a multiple of the job's TP degree). Data- and pipeline-parallel groups may cross nodes,
so with `span_nodes` a job that fits on no single node is split across nodes (its own node
first, then the nodes with the most free GPUs, so as few nodes as possible), among the nodes
that may be spanned (`spannable`: their agents advertised an address the others reach).
Without it, or beyond what those nodes hold, a count that fits on no node is lowered to the
largest allowed count that does. Either way, every job placed with fewer GPUs than its target
gets a reason in `Placed.short`, which the caller records.

Jobs stay where they are when the plan fits there: a job without slots (placed in `order`,
maybe before a running job that grows) goes where it leaves free the GPUs that jobs placed after
it need to stay put (a running job's growth on its own node, a paused job's count on its home
node), wherever some node holds it so.

With `move_jobs`, a job that would be placed short because the free GPUs are scattered over
nodes gets a node made whole for it instead: it moves to a node with room, or jobs inside one
node move, whole and at their counts, off a node onto others' free GPUs (the cheapest moves: the
fewest running jobs moved, the job itself included, then their fewest GPUs, then paused jobs
placed off their home node, then jobs not yet started; the job's own node first). Each move of
a running or paused job is in `Placed.moved` with its reason: it costs the moved job a switch
across nodes. `movable` limits which jobs holding slots may move (the live rule:
`LIVE_MOVABLE`); jobs without slots are placed wherever makes room.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations

from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem, evaluate_gpus

Part = tuple[int, tuple[int, ...]]
"""(node id, slot indices on that node)."""


@dataclass(frozen=True)
class NodeSlots:
    """A ready node and the indices of its GPU slots."""

    node_id: int
    slot_indices: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Where a job runs: a node and slot indices (empty = not running), plus further nodes.

    `node_id` is the job's own node (where its runner and rendezvous live); `others` are the
    parts on further nodes of a job that spans nodes (empty for a job inside one node).
    """

    node_id: int | None
    slot_indices: tuple[int, ...]
    others: tuple[Part, ...] = ()

    @property
    def gpus(self) -> int:
        """Number of GPUs placed, all nodes together."""
        return len(self.slot_indices) + sum(len(s) for _, s in self.others)

    @property
    def parts(self) -> tuple[Part, ...]:
        """Every (node, slots) part, the job's own node first."""
        if self.node_id is None:
            return ()
        return ((self.node_id, self.slot_indices), *self.others)


NOWHERE = Placement(None, ())


@dataclass
class Placed:
    """Placements by job, and why a job got fewer GPUs than the plan asked for."""

    placements: dict[int, Placement] = field(default_factory=dict)
    short: dict[int, str] = field(default_factory=dict)
    # Jobs moved whole to another node to make room for another job (`move_jobs`), and why.
    moved: dict[int, str] = field(default_factory=dict)


def _from_parts(parts: Sequence[Part]) -> Placement:
    parts = [(n, tuple(sorted(s))) for n, s in parts if s]
    if not parts:
        return NOWHERE
    (node, slots), *others = parts
    return Placement(node, slots, tuple(others))


def place(
    targets: Mapping[int, int],
    current: Mapping[int, Placement],
    nodes: Sequence[NodeSlots],
    allowed: Mapping[int, Sequence[int]],
    order: Sequence[int],
    home: Mapping[int, int] | None = None,
) -> dict[int, Placement]:
    """`place_jobs` inside single nodes, placements only."""
    return place_jobs(targets, current, nodes, allowed, order, home).placements


def place_jobs(
    targets: Mapping[int, int],
    current: Mapping[int, Placement],
    nodes: Sequence[NodeSlots],
    allowed: Mapping[int, Sequence[int]],
    order: Sequence[int],
    home: Mapping[int, int] | None = None,
    tp: Mapping[int, int] | None = None,
    span_nodes: bool = False,
    spannable: Collection[int] | None = None,
    move_jobs: bool = False,
    movable: Collection[int] | None = None,
) -> Placed:
    """Placement for every job in `targets` (GPU counts), honouring `order` (most important first).

    A job keeps its node and the slots it holds, and grows on its own node first; a job that
    must grow beyond its node adds parts on other nodes (`span_nodes`, where its node may be
    spanned), else stays on its node at the largest allowed count that node holds.
    A job without slots goes back to its `home` node (where its paused state lives in the
    agent's memory) when that node has room for it. `tp`: each job's tensor-parallel degree
    (default 1): every part holds a multiple of it. A count that cannot be placed is lowered
    to the largest allowed count that can (possibly 0), with the reason in `short`.
    `spannable`: the nodes a job may span (their agents reach each other; None: every node);
    a job inside one node may sit on any node. `move_jobs`: a job that would be placed short
    gets a node made whole for it by moving jobs (`_make_room`), recorded in `moved`;
    `movable`: the jobs holding slots in `current` that may move (None: every one).
    """
    capacity = {n.node_id: len(n.slot_indices) for n in nodes}
    span_ok = set(spannable) if spannable is not None else {n.node_id for n in nodes}
    free: dict[int, list[int]] = {n.node_id: sorted(n.slot_indices) for n in nodes}
    tp = tp or {}
    out = Placed()
    held: dict[int, list[Part]] = {}
    # Slots held by jobs that keep running on a ready node are not free.
    for job_id, existing in current.items():
        if job_id not in targets:
            continue
        ready = [(n, s) for n, s in existing.parts if n in free]
        if ready:
            held[job_id] = ready
            for n, slots in ready:
                free[n] = [i for i in free[n] if i not in slots]
    # Jobs holding slots that may move to make room for another (a job without slots always may).
    may_move = frozenset(held) if movable is None else frozenset(held).intersection(movable)
    # Shrinking and stopping first, so their slots are free for the others.
    for job_id in order:
        mine = held.get(job_id)
        target = targets.get(job_id, 0)
        if mine is None or target > sum(len(s) for _, s in mine):
            continue
        step = max(1, tp.get(job_id, 1)) if span_nodes else 1
        kept: list[Part] = []
        left = target
        for n, slots in mine:  # the job's own node first: its other nodes go first
            take = min(len(slots), left)
            take -= take % step
            kept.append((n, slots[:take]))
            free[n] = sorted([*free[n], *slots[take:]])
            left -= take
        out.placements[job_id] = _from_parts(kept)
        if left:
            out.short[job_id] = (
                f"{target} GPUs asked, {target - left} placed: each node's part holds whole "
                f"tensor-parallel groups of {step}"
            )
    reserved, reserve_of = _reservations(targets, order, out.placements, held, free, home)
    for job_id in order:
        if job_id in out.placements:
            continue
        target = targets.get(job_id, 0)
        if not target:
            # Nothing to place (most of a long queue): no search over every node for it.
            out.placements[job_id] = NOWHERE
            continue
        if job_id in reserve_of:
            # Its own room: what it reserved is free for it now.
            node_id, count = reserve_of.pop(job_id)
            reserved[node_id] -= count
        step = max(1, tp.get(job_id, 1)) if span_nodes else 1
        counts = sorted(
            {g for g in allowed.get(job_id, (target,)) if 0 < g <= target}, reverse=True
        ) or ([target] if target else [])
        mine = held.get(job_id)
        if mine is not None:
            placement, why = _grow(mine, target, counts, step, free, span_nodes, span_ok, reserved)
        else:
            home_id = (home or {}).get(job_id)
            if home_id in free and 0 < target <= len(free[home_id]) and target % step == 0:
                taken = tuple(free[home_id][:target])
                del free[home_id][:target]
                out.placements[job_id] = Placement(home_id, taken)
                continue
            placement, why = _place_new(target, counts, step, free, span_nodes, span_ok, reserved)
            if (
                move_jobs
                and placement.gpus == target
                and not placement.others
                and any(len(free[n]) < reserved[n] for n, _ in placement.parts)
            ):
                # It took GPUs reserved for a job placed later (best fit packed the jobs before
                # it badly): moving jobs that have not started yet may make room elsewhere.
                before = _give_back(free, placement, None)
                made = _make_room(
                    job_id, target, None, before, capacity, out, held, frozenset(), home,
                    reserved=reserved, not_started_only=True,
                )  # fmt: skip
                if made is not None:
                    free, placement = before, made
        if move_jobs and placement.gpus < target:
            # The free slots before this job took any: where moving jobs starts from (copied
            # only for a job placed short, not for every job of a long queue).
            before = _give_back(free, placement, mine)
            made = (
                _make_room(job_id, target, mine, before, capacity, out, held, may_move, home)
                if target % step == 0  # whole tensor-parallel groups, as every placement
                else None
            )
            if made is not None:
                free, placement = before, made
        out.placements[job_id] = placement
        if placement.gpus < target:
            out.short[job_id] = f"{target} GPUs asked, {placement.gpus} placed: {why}"
    return out


def place_plan(
    gpus: Mapping[int, Sequence[int]],
    current: Mapping[int, Placement],
    nodes: Sequence[NodeSlots],
    allowed: Mapping[int, Sequence[int]],
    order: Sequence[int],
    home: Mapping[int, int] | None = None,
    tp: Mapping[int, int] | None = None,
    span_nodes: bool = False,
    spannable: Collection[int] | None = None,
    move_jobs: bool = False,
    movable: Collection[int] | None = None,
) -> dict[int, tuple[int, ...]]:
    """The GPU counts each slot of a plan (`gpus`: counts per job and slot) runs at once placed:
    `place_jobs` on every slot in turn, each from where the slot before left the jobs."""
    rows: dict[int, list[int]] = {job_id: [] for job_id in gpus}
    homes = dict(home or {})
    last: dict[int, int] | None = None
    settled = False  # the last slot's placement left every job where it was
    for t in range(max((len(row) for row in gpus.values()), default=0)):
        targets = {job_id: row[t] for job_id, row in gpus.items()}
        if not (settled and targets == last):
            # Else the same inputs as the slot before (targets, placements, homes): the same
            # placement, not searched again (a plan's counts hold for long stretches).
            before = current
            current = place_jobs(
                targets,
                current,
                nodes,
                allowed,
                order,
                homes,
                tp,
                span_nodes,
                spannable,
                move_jobs,
                movable,
            ).placements
            settled = t > 0 and targets == last and current == before
        last = targets
        for job_id, row in rows.items():
            where = current.get(job_id, NOWHERE)
            row.append(where.gpus)
            if where.node_id is not None:
                homes[job_id] = where.node_id
    return {job_id: tuple(row) for job_id, row in rows.items()}


# The jobs holding slots that the live service's placement may move to another node: every one
# (None). The dispatcher moves a running job in two steps: a pause on its node (the agent
# checkpoints it and frees the slots), answered before the start on the new node, which resumes
# from that checkpoint (`dispatch/service._decide_job`, `deliveries`).
LIVE_MOVABLE: frozenset[int] | None = None


@dataclass(frozen=True)
class NodeFacts:
    """The ready nodes as the loop places jobs on them: their slots, the nodes a job may span,
    where each job holds slots now, paused jobs' home nodes, and jobs' tensor-parallel degrees.

    `place` (the dispatcher, `dispatch/service.decide`) and `place_rows` (admission's check of a
    plan) place with the same rules: jobs keep their slots, a paused job goes back to its home
    node, a job spans only the spannable nodes in whole tensor-parallel groups, and a count that
    fits on no node as jobs sit gets a node made whole for it by moving jobs (`LIVE_MOVABLE`;
    a running job moves by a pause and a start, see `docs/service.md`). The simulator places
    through it too (`simulate/engine.NodePlacer`), where `move_jobs` and `movable` can be set to
    ask what other rules would give.
    """

    nodes: tuple[NodeSlots, ...] = ()
    spannable: frozenset[int] = frozenset()
    current: Mapping[int, Placement] = field(default_factory=dict)
    tp: Mapping[int, int] = field(default_factory=dict)
    homes: Mapping[int, int] = field(default_factory=dict)
    move_jobs: bool = True
    movable: frozenset[int] | None = LIVE_MOVABLE

    def pooled(self) -> bool:
        """Whether placement holds every count that fits pooled capacity: one ready node, or
        every ready node may be spanned, and no job with tensor-parallel groups."""
        one_pool = len(self.nodes) <= 1 or all(n.node_id in self.spannable for n in self.nodes)
        return one_pool and all(d <= 1 for d in self.tp.values())

    def place(
        self, targets: Mapping[int, int], allowed: Mapping[int, Sequence[int]], order: Sequence[int]
    ) -> Placed:
        """One slot's counts (`targets`) placed from where the jobs are now, as the loop sends
        them."""
        return place_jobs(
            targets,
            {j: self.current.get(j, NOWHERE) for j in targets},
            self.nodes,
            allowed,
            order,
            home=self.homes,
            tp=self.tp,
            span_nodes=True,
            spannable=self.spannable,
            move_jobs=self.move_jobs,
            movable=self.movable,
        )

    def place_rows(
        self,
        gpus: Mapping[int, Sequence[int]],
        allowed: Mapping[int, Sequence[int]],
        order: Sequence[int],
    ) -> dict[int, tuple[int, ...]]:
        """`place_plan` of `gpus` from where the jobs are now, each slot placed as `place`
        places it."""
        return place_plan(
            gpus,
            {j: self.current.get(j, NOWHERE) for j in gpus},
            self.nodes,
            allowed,
            order,
            home=self.homes,
            tp=self.tp,
            span_nodes=True,
            spannable=self.spannable,
            move_jobs=self.move_jobs,
            movable=self.movable,
        )


def job_placement(by_node: Mapping[int, Sequence[int]], own: int | None) -> Placement:
    """A job's placement from its slot indices per node: `own` (its newest command's node, where
    its runner is) first where it holds slots there, else the node holding most of them."""
    if not by_node:
        return NOWHERE
    first = (
        own
        if own is not None and own in by_node
        else min(by_node, key=lambda n: (-len(by_node[n]), n))
    )
    return Placement(
        first,
        tuple(sorted(by_node[first])),
        tuple((n, tuple(sorted(ix))) for n, ix in sorted(by_node.items()) if n != first),
    )


def lost_once_placed(
    problem: AllocationProblem,
    plan: AllocationPlan,
    new_jobs: Collection[str],
    placed: Callable[[dict[str, tuple[int, ...]]], dict[str, tuple[int, ...]]],
) -> list[str]:
    """Deadlines an admission plan meets on pooled capacity that it loses once placed (`placed`:
    rows of counts per job -> the counts placement runs): a new job's, or another's that the
    plan without the new jobs keeps placed."""
    ids = {j.job_id for j in problem.jobs}
    with_new = evaluate_gpus(problem, placed(dict(plan.gpus))).deadline_met
    base = replace(problem, jobs=tuple(j for j in problem.jobs if j.job_id not in new_jobs))
    without = evaluate_gpus(
        base, placed({j: r for j, r in plan.gpus.items() if j not in new_jobs})
    ).deadline_met
    return sorted(
        j
        for j, met in plan.deadline_met.items()
        if met
        and j in ids
        and not with_new.get(j, False)
        and (j in new_jobs or without.get(j, False))
    )


def tp_degree(layout: str | None) -> int:
    """The tensor-parallel degree of a layout label `dp{d}-tp{t}-pp{p}` (1 when unknown)."""
    for part in (layout or "").split("-"):
        if part.startswith("tp") and part[2:].isdigit():
            return max(1, int(part[2:]))
    return 1


def _give_back(
    free: Mapping[int, list[int]], placement: Placement, mine: list[Part] | None
) -> dict[int, list[int]]:
    """A copy of `free` with the slots `placement` took (those not in `mine`) free again."""
    out = {n: list(s) for n, s in free.items()}
    had = {(n, i) for n, slots in mine or () for i in slots}
    for n, slots in placement.parts:
        out[n] = sorted([*out[n], *(i for i in slots if (n, i) not in had)])
    return out


def _reservations(
    targets: Mapping[int, int],
    order: Sequence[int],
    placed: Mapping[int, Placement],
    held: Mapping[int, list[Part]],
    free: Mapping[int, list[int]],
    home: Mapping[int, int] | None,
) -> tuple[dict[int, int], dict[int, tuple[int, int]]]:
    """GPUs per node that jobs still to be placed need to stay where they are (a running job's
    growth on its own node, a paused job's count on its home node), and each job's share.

    A job placed before them in `order` goes elsewhere when it can (`_place_new`, `_grow`):
    else a running job placed after it could grow only by moving, or a paused one resume only
    off the node that holds its state."""
    reserved = dict.fromkeys(free, 0)
    reserve_of: dict[int, tuple[int, int]] = {}
    for job_id in order:
        target = targets.get(job_id, 0)
        if not target or job_id in placed:
            continue
        mine = held.get(job_id)
        if mine is not None:
            # What it can grow by on its own node (the rest it spans, or goes without).
            node_id = mine[0][0]
            count = min(target - sum(len(s) for _, s in mine), len(free[node_id]))
        elif home is not None and home.get(job_id) in free and target <= len(free[home[job_id]]):
            node_id, count = home[job_id], target  # else it cannot go home anyway
        else:
            continue
        if count > 0:
            reserved[node_id] += count
            reserve_of[job_id] = (node_id, count)
    return reserved, reserve_of


def _unreserved(free: Mapping[int, list[int]], reserved: Mapping[int, int], node_id: int) -> int:
    """Free GPUs of a node that no job still to be placed needs to stay where it is."""
    return len(free[node_id]) - reserved.get(node_id, 0)


def _most_free(
    free: dict[int, list[int]], skip: set[int], reserved: Mapping[int, int] | None = None
) -> list[int]:
    """Nodes not in `skip`, those with the most free GPUs no one reserved first."""
    reserved = reserved or {}
    return sorted(
        (n for n in free if n not in skip),
        key=lambda n: (-_unreserved(free, reserved, n), -len(free[n]), n),
    )


def _grow(
    parts: list[Part],
    target: int,
    counts: list[int],
    step: int,
    free: dict[int, list[int]],
    span_nodes: bool,
    span_ok: set[int],
    reserved: Mapping[int, int] | None = None,
) -> tuple[Placement, str]:
    """Grow a running job: its own node first, then (span_nodes) its other nodes, then more
    (those with the most free GPUs that no job placed later reserved first)."""
    have = sum(len(s) for _, s in parts)
    own = parts[0][0]
    if span_nodes and own not in span_ok:
        # Its runner's node may not span (any more): it grows only where it already is.
        if len(parts) == 1:
            span_nodes = False
        else:
            span_ok = {n for n, _ in parts}
    if not span_nodes:
        spare = len(free[own])
        if target - have <= spare:
            grown = target
        else:
            grown = max((g for g in counts if have <= g <= have + spare), default=have)
        added = free[own][: grown - have]
        del free[own][: grown - have]
        why = f"its node {own} has {spare} more free GPUs and a job runs inside one node"
        return _from_parts([(own, parts[0][1] + tuple(added)), *parts[1:]]), why
    room = {n: len(free[n]) - len(free[n]) % step for n in free}
    order = [n for n, _ in parts] + _most_free(
        free, {n for n, _ in parts} | (set(free) - span_ok), reserved
    )
    avail = have + sum(room[n] for n in order)
    fits = [g for g in counts if have <= g <= avail and (g - have) % step == 0] or [have]
    extra = fits[0] - have
    by_node = dict(parts)
    for n in order:
        take = min(extra, room[n])
        take -= take % step
        if take:
            by_node[n] = by_node.get(n, ()) + tuple(free[n][:take])
            del free[n][:take]
            extra -= take
    ordered = [(n, by_node[n]) for n in order if n in by_node]
    why = f"{avail - have} more free GPUs in whole tensor-parallel groups of {step} on ready nodes"
    return _from_parts(ordered), why


def _place_new(
    target: int,
    counts: list[int],
    step: int,
    free: dict[int, list[int]],
    span_nodes: bool,
    span_ok: set[int],
    reserved: Mapping[int, int] | None = None,
) -> tuple[Placement, str]:
    """A job without slots: best fit on one node; else (span_nodes) across the fewest nodes
    that may be spanned, when that holds more than any one node. Either way it takes GPUs
    `reserved` for jobs placed later only where no other node holds it."""
    reserved = reserved or {}
    most = max((len(s) for s in free.values()), default=0)
    one_node = [c for c in counts if c % step == 0]
    single: tuple[int, int] | None = None
    for count in one_node:
        # Best fit: the node with the fewest free slots that still holds the job, counting only
        # those no job placed later reserved where any node holds it so.
        fitting = [
            (spare < count, spare if spare >= count else len(slots), n)
            for n, slots in free.items()
            if len(slots) >= count
            for spare in (_unreserved(free, reserved, n),)
        ]
        if fitting:
            single = (count, min(fitting)[2])
            break
    room = {n: len(free[n]) - len(free[n]) % step for n in free if n in span_ok}
    avail = sum(room.values())
    spanned = next((c for c in one_node if c <= avail), 0) if span_nodes else 0
    if single is not None and (single[0] == target or single[0] >= spanned):
        count, node_id = single
        taken = tuple(free[node_id][:count])
        del free[node_id][:count]
        return Placement(node_id, taken), (
            _why_spanning(avail, step) if span_nodes else _why_one_node(target, most)
        )
    if not spanned:
        return NOWHERE, _why_spanning(avail, step) if span_nodes else _why_one_node(target, most)
    parts: list[Part] = []
    left = spanned
    for n in _most_free(free, set(free) - span_ok, reserved):
        take = min(left, room[n])
        if take:
            parts.append((n, tuple(free[n][:take])))
            del free[n][:take]
            left -= take
    return _from_parts(parts), _why_spanning(avail, step)


# Bounds on the search for jobs to move: the jobs looked at (those on the nodes with the most
# free GPUs first), the most moved for one job, and the sets of jobs tried.
MOVE_CANDIDATES = 12
MOVE_MOST_JOBS = 4
MOVE_SETS = 1_000


def _make_room(
    job_id: int,
    target: int,
    mine: list[Part] | None,
    free: dict[int, list[int]],
    capacity: Mapping[int, int],
    out: Placed,
    held: dict[int, list[Part]],
    may_move: frozenset[int],
    home: Mapping[int, int] | None,
    reserved: Mapping[int, int] | None = None,
    not_started_only: bool = False,
) -> Placement | None:
    """`job_id` whole on one node at `target` GPUs, made room for by moving jobs, or None.

    With `reserved`, the GPUs reserved on each node (`_reservations`) are no room for the job or
    for the jobs moved; with `not_started_only`, only jobs placed in this pass without slots
    before it (and away from their home node) may move.
    `free` is as before the job took any slots. Jobs inside one node may move whole, at the
    counts they have now, to other nodes (those holding slots before this pass only if in
    `may_move`; a paused job moved off its `home` node is recorded as moved too); the job itself
    may leave its node if it may move. The search takes the cheapest set of moves by
    `_move_cost`: the fewest running jobs moved (the job itself leaving its node counts), then
    their fewest GPUs, then paused jobs off their home, then jobs not yet started (up to
    `MOVE_MOST_JOBS` jobs), the job's own node first; it is exact within those bounds (every set
    of jobs, every packing). On success `free`, `out` (placements, `moved`) and `held` are
    updated; else nothing is.
    """
    if mine is not None and len(mine) > 1:
        return None  # a job across nodes grows by spanning, not by moving others
    if max(capacity.values(), default=0) < target:
        return None
    own, own_slots = mine[0] if mine else (None, ())
    # Jobs inside one node, where they sit now in this pass (placed already, or held).
    inside: dict[int, Part] = {}
    # A job moves at most once a pass.
    for other, where in out.placements.items():
        if (
            other not in (job_id, *out.moved)
            and where.node_id is not None
            and not where.others
            and (other not in held or other in may_move)
        ):
            inside[other] = (where.node_id, where.slot_indices)
    for other, parts in held.items():
        if (
            other not in (job_id, *out.moved, *out.placements)
            and len(parts) == 1
            and other in may_move
        ):
            inside[other] = parts[0]
    rooms = {n: len(s) - (reserved or {}).get(n, 0) for n, s in free.items()}
    if own is not None:
        rooms[own] += len(own_slots)  # the job's own slots are room for it wherever it goes
    if sum(rooms.values()) < target:
        return None  # moving jobs frees no GPUs: not enough free in all
    cost = {k: _move_cost(k, inside[k], held, home) for k in inside}
    if not_started_only:
        inside = {k: part for k, part in inside.items() if cost[k] >> 2 * _COST_BITS == 0}
    candidates = sorted(
        inside,
        key=lambda k: (
            -rooms[inside[k][0]],
            cost[k] >> 2 * _COST_BITS,
            inside[k][0],
            len(inside[k][1]),
            k,
        ),
    )[:MOVE_CANDIDATES]
    sizes = {k: len(inside[k][1]) for k in candidates}
    # The job itself leaving its node is a running job's move too.
    leaving = _move_cost(job_id, (own, own_slots), {job_id: []}, None) if own is not None else 0
    # Every set of candidates with its cost (the sum of its jobs' packed costs), cheapest first.
    costs = [cost[k] for k in candidates]
    subsets = sorted(
        pair
        for count in range(min(MOVE_MOST_JOBS, len(candidates)) + 1)
        for pair in zip(
            map(sum, combinations(costs, count)), combinations(candidates, count), strict=True
        )
    )[:MOVE_SETS]
    best: tuple[int, int, dict[int, int]] | None = None
    for key, subset in subsets:
        if best is not None and key >= best[0]:
            break  # no cheaper set is left (the job's own move only adds to a set's cost)
        left = dict(rooms)
        for k in subset:
            left[inside[k][0]] += sizes[k]
        for node in sorted(left, key=lambda n: (n != own, left[n], n)):
            if left[node] < target or capacity[node] < target:
                continue
            if own is not None and node != own and job_id not in may_move:
                continue  # it holds slots it may not leave: room only on its own node
            left[node] -= target
            fit = _pack({k: sizes[k] for k in subset}, left, {k: inside[k][0] for k in subset})
            left[node] += target
            if fit is not None:
                if node != own:
                    key += leaving
                if best is None or key < best[0]:
                    best = (key, node, fit)
                # Nodes are tried own node first, then every other at the same cost.
                break
    if best is None:
        return None
    _, node, fit = best
    return _apply_moves(job_id, target, own, own_slots, node, fit, inside, free, out, held, home)


# Bits per field of a packed move cost: sums of up to MOVE_MOST_JOBS + 1 jobs' GPUs never carry.
_COST_BITS = 24


def _move_cost(
    job_id: int, where: Part, held: Mapping[int, object], home: Mapping[int, int] | None
) -> int:
    """What moving a job from `where` costs, packed into one integer so that costs add up and
    compare as the tuple (running jobs, their GPUs, paused jobs off their home node, their GPUs,
    jobs, GPUs) would. A running job's move is a pause, a checkpoint and a restart; a paused
    one resumes off the node holding its state (from a checkpoint); a job not yet started goes
    anywhere at no cost."""
    gpus = len(where[1])
    if job_id in held:
        fields = (1, gpus, 0, 0, 1, gpus)
    elif (home or {}).get(job_id) == where[0]:
        fields = (0, 0, 1, gpus, 1, gpus)
    else:
        fields = (0, 0, 0, 0, 1, gpus)
    packed = 0
    for value in fields:
        packed = (packed << _COST_BITS) + value
    return packed


def _apply_moves(
    job_id: int,
    target: int,
    own: int | None,
    own_slots: tuple[int, ...],
    node: int,
    fit: dict[int, int],
    inside: dict[int, Part],
    free: dict[int, list[int]],
    out: Placed,
    held: dict[int, list[Part]],
    home: Mapping[int, int] | None,
) -> Placement:
    """Move the jobs of `fit` (job -> node) and place `job_id` on `node` (`_make_room`)."""
    for other in fit:
        at, slots = inside[other]
        free[at] = sorted([*free[at], *slots])
    kept = own_slots if node == own else ()
    if own is not None and node != own:
        free[own] = sorted([*free[own], *own_slots])
        out.moved[job_id] = f"moved from node {own} to node {node}, where {target} GPUs fit"
    added = tuple(free[node][: target - len(kept)])
    del free[node][: target - len(kept)]
    for other, to in fit.items():
        at, slots = inside[other]
        taken = tuple(free[to][: len(slots)])
        del free[to][: len(slots)]
        if other in out.placements:
            out.placements[other] = Placement(to, taken)
        else:
            held[other] = [(to, taken)]
        if other not in held:
            if (home or {}).get(other) == at:
                # Its paused state is in its home node's memory: elsewhere it resumes from its
                # newest checkpoint (or, with none, from step 0), which its start then reports.
                out.moved[other] = (
                    f"placed on node {to}, not on its home node {at} where its paused state is, "
                    f"to make room for job {job_id}'s {target} GPUs on node {node}"
                )
            continue  # not running before this pass: placed elsewhere, not moved
        out.moved[other] = (
            f"moved whole from node {at} to node {to} to make room for job {job_id}'s "
            f"{target} GPUs on node {node}"
        )
    return Placement(node, tuple(sorted(kept + added)))


def _pack(
    sizes: dict[int, int], rooms: dict[int, int], away: Mapping[int, int]
) -> dict[int, int] | None:
    """Each job (GPUs) onto one node with room other than `away[job]`, all at once (exact,
    largest first), or None."""
    items = sorted(sizes, key=lambda j: (-sizes[j], j))
    left = dict(rooms)
    where: dict[int, int] = {}

    def fill(i: int) -> bool:
        if i == len(items):
            return True
        job = items[i]
        later = {away[j] for j in items[i + 1 :]}
        seen: set[tuple[int, int | None]] = set()
        # Best fit first; two nodes with the same room left are the same choice unless a later
        # job may not go to one of them.
        for node in sorted(left, key=lambda n: (left[n], n)):
            same = (left[node], node if node in later else None)
            if node == away[job] or left[node] < sizes[job] or same in seen:
                continue
            seen.add(same)
            left[node] -= sizes[job]
            where[job] = node
            if fill(i + 1):
                return True
            left[node] += sizes[job]
        return False

    return where if fill(0) else None


def _why_one_node(target: int, most: int) -> str:
    return (
        f"no ready node has {target} free GPUs (most on one node: {most}) and a job runs inside "
        "one node"
    )


def _why_spanning(avail: int, step: int) -> str:
    return (
        f"{avail} free GPUs in whole tensor-parallel groups of {step} on the ready nodes a job "
        "may span, and no one node has more"
    )
