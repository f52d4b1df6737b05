"""A job's captured output on the agent: one file per worker process, capped, read by rank.

    <data_dir>/logs/job-<id>/worker-<w>.log            stdout + stderr of worker w
    <data_dir>/logs/job-<id>/worker-<w>.log.scalars    greenflow_log() lines (JSON) of worker w
    <data_dir>/logs/job-<id>/ranks.json                worker of each rank: newest layout, and
                                                       the last holder of every rank ever run
    <file>.dropped                                     bytes cut from the file's start so far

Offsets are logical (bytes since the file began, cut bytes included), so a reader that follows
a file keeps its place across cuts; a reader behind the cut is told how much it missed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from worker_agent.protocol import MAX_LOG_CHUNK_BYTES as MAX_CHUNK_BYTES
from worker_agent.protocol import JobLogChunk, JobScalarCurve

Stream = Literal["output", "scalars"]

DEFAULT_MAX_BYTES = 2 << 20
"""Cap per file (each worker's output, each worker's scalars); the older half goes first."""


def job_dir(root: Path, job_id: int) -> Path:
    """Where job `job_id`'s files are."""
    return root / f"job-{job_id}"


def _read_ranks(directory: Path) -> tuple[list[int], list[int]]:
    """(newest layout, last holder of each rank ever run); an older file held the layout only."""
    try:
        stored = json.loads((directory / "ranks.json").read_text())
    except (OSError, ValueError):
        return [], []
    if isinstance(stored, list):
        return [int(w) for w in stored], [int(w) for w in stored]
    return [int(w) for w in stored["layout"]], [int(w) for w in stored["last_holder"]]


def record_ranks(directory: Path, worker_ids: list[int]) -> None:
    """Remember which worker holds each rank now (written at start and at every switch)."""
    directory.mkdir(parents=True, exist_ok=True)
    _, last_holder = _read_ranks(directory)
    # A job shrunk from 2 ranks to 1 still answers for rank 1: its last worker's output stays.
    last_holder[: len(worker_ids)] = worker_ids
    tmp = directory / "ranks.json.tmp"
    tmp.write_text(json.dumps({"layout": worker_ids, "last_holder": last_holder}))
    tmp.replace(directory / "ranks.json")


def _worker_of(directory: Path, rank: int) -> int | None:
    _, last_holder = _read_ranks(directory)
    return last_holder[rank] if 0 <= rank < len(last_holder) else None


def _dropped(path: Path) -> int:
    try:
        return int(Path(f"{path}.dropped").read_text())
    except (OSError, ValueError):
        return 0


def _after_newline(path: Path, position: int) -> bool:
    """Whether the byte before `position` in `path` ends a line."""
    try:
        with path.open("rb") as fh:
            fh.seek(position - 1)
            return fh.read(1) == b"\n"
    except OSError:
        return False


def read_chunk(
    root: Path,
    job_id: int,
    rank: int = 0,
    stream: Stream = "output",
    offset: int = 0,
    limit: int = MAX_CHUNK_BYTES,
    tail: int | None = None,
) -> JobLogChunk:
    """Up to `limit` bytes of the stream of the worker at `rank`, from logical `offset`; with
    `tail`, the newest `tail` bytes instead (from a line start where one is in them)."""
    directory = job_dir(root, job_id)
    worker = _worker_of(directory, rank)
    empty = JobLogChunk(job_id=job_id, rank=rank, stream=stream, offset=offset, next_offset=offset)
    if worker is None:
        return empty
    path = directory / f"worker-{worker}.log"
    if stream == "scalars":
        path = Path(f"{path}.scalars")
    dropped = _dropped(path)
    limit = max(0, min(limit, MAX_CHUNK_BYTES))
    try:
        if tail is not None:
            size = path.stat().st_size
            limit = max(0, min(tail, MAX_CHUNK_BYTES))
            offset = start = dropped + max(0, size - limit)
        else:
            start = max(offset, dropped)
        with path.open("rb") as fh:
            fh.seek(start - dropped)
            data = fh.read(limit)
    except OSError:
        return empty
    cut_line = tail is not None and start > dropped and not _after_newline(path, start - dropped)
    if cut_line and b"\n" in data[:-1]:
        # Begin at a whole line: the tail's first bytes are the end of a cut one.
        cut = data.index(b"\n") + 1
        data, start = data[cut:], start + cut
        offset = start
    if stream == "scalars" and b"\n" in data:
        data = data[: data.rindex(b"\n") + 1]  # whole JSON lines only
    return JobLogChunk(
        job_id=job_id,
        rank=rank,
        worker=worker,
        stream=stream,
        offset=start,
        next_offset=start + len(data),
        skipped_bytes=start - offset,
        text=data.decode("utf-8", errors="replace"),
    )


def trim(root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Cut every file over `max_bytes` to its newest half; return the bytes cut.

    Workers append with O_APPEND, so after the cut their writes land at the new end; a line
    written during the cut itself may be lost (the cap is a bound, not a ledger)."""
    cut = 0
    for path in root.glob("job-*/worker-*.log*"):
        if path.name.endswith((".dropped", ".tmp")):
            continue
        try:
            size = path.stat().st_size
            if size <= max_bytes:
                continue
            keep = max_bytes // 2
            with path.open("r+b") as fh:
                fh.seek(size - keep)
                tail = fh.read()
                fh.seek(0)
                fh.truncate(0)
                fh.write(tail)
            removed = size - len(tail)
            marker = Path(f"{path}.dropped")
            tmp = Path(f"{marker}.tmp")
            tmp.write_text(str(_dropped(path) + removed))
            os.replace(tmp, marker)
            cut += removed
        except OSError:
            continue
    return cut


def scalar_curve(root: Path, job_id: int, max_points: int = 2000) -> JobScalarCurve:
    """Each logged scalar's mean per step over every worker's lines (all ranks, micro-batches
    and layouts: the curve runs on across hot switches and restarts); at most `max_points`
    steps, evenly thinned, the newest kept."""
    sums: dict[int, dict[str, list[float]]] = {}
    lines = 0
    for path in sorted(job_dir(root, job_id).glob("worker-*.log.scalars")):
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        for line in raw.splitlines():
            try:
                entry = json.loads(line)
                step = int(entry["step"])
                values = entry["scalars"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by the size cap, or half written
            if not isinstance(values, dict):
                continue
            lines += 1
            at = sums.setdefault(step, {})
            for name, value in values.items():
                if isinstance(value, int | float):
                    total = at.setdefault(str(name), [0.0, 0.0])
                    total[0] += float(value)
                    total[1] += 1
    steps = sorted(sums)
    if len(steps) > max_points > 0:
        stride = -(-len(steps) // max_points)
        # Thin from the newest step back, so the latest point is always shown.
        steps = steps[::-1][::stride][::-1]
    names = sorted({name for step in steps for name in sums[step]})
    series: dict[str, list[float | None]] = {}
    for name in names:
        column: list[float | None] = []
        for step in steps:
            mean = sums[step].get(name)
            column.append(mean[0] / mean[1] if mean else None)
        series[name] = column
    return JobScalarCurve(job_id=job_id, steps=steps, series=series, lines=lines)
