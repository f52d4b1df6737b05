"""Captured job output on the agent: read by rank, capped, offsets that survive the cap."""

from __future__ import annotations

import json
from pathlib import Path

from worker_agent import joblog
from worker_agent.logstore import job_dir, read_chunk, record_ranks, scalar_curve, trim


def test_output_is_read_by_rank_from_logical_offsets_across_cuts(tmp_path: Path) -> None:
    directory = job_dir(tmp_path, 3)
    record_ranks(directory, [5, 2])
    (directory / "worker-2.log").write_text("rank one\n")
    log5 = directory / "worker-5.log"
    log5.write_text("".join(f"line {i:04d}\n" for i in range(200)))  # 2000 bytes
    first = read_chunk(tmp_path, 3, rank=0, limit=100)
    assert first.worker == 5 and first.text.startswith("line 0000") and first.next_offset == 100
    assert read_chunk(tmp_path, 3, rank=1).text == "rank one\n"
    assert read_chunk(tmp_path, 3, rank=2).worker is None  # no such rank: nothing, not an error
    assert trim(tmp_path, max_bytes=1000) == 1500  # the newest half of the cap is kept
    assert log5.stat().st_size == 500
    behind = read_chunk(tmp_path, 3, rank=0, offset=first.next_offset)
    assert behind.skipped_bytes == 1400 and behind.offset == 1500
    assert behind.text.startswith("line 0150") and behind.next_offset == 2000
    with log5.open("a") as fh:  # the worker keeps appending after the cut
        fh.write("line 0200\n")
    assert read_chunk(tmp_path, 3, rank=0, offset=2000).text == "line 0200\n"
    # Shrunk to one rank (another worker): rank 1's output is still its last worker's.
    record_ranks(directory, [7])
    (directory / "worker-7.log").write_text("after the switch\n")
    assert read_chunk(tmp_path, 3, rank=0).text == "after the switch\n"
    assert read_chunk(tmp_path, 3, rank=1).text == "rank one\n"


def test_scalars_are_json_lines_with_step_and_rank(tmp_path: Path) -> None:
    directory = job_dir(tmp_path, 4)
    record_ranks(directory, [0])
    joblog.greenflow_log(loss=1.0)  # unbound: a no-op, as in a plain script
    where = {"step": 7}
    joblog.bind(str(directory / "worker-0.log.scalars"), lambda: (where["step"], 0))
    try:
        joblog.greenflow_log(loss=2.5, note="not a number", bad=float("nan"))  # type: ignore[arg-type]
        where["step"] = 8
        joblog.log(loss=2.0, accuracy=1)
    finally:
        joblog.unbind()
    chunk = read_chunk(tmp_path, 4, stream="scalars")
    lines = [json.loads(line) for line in chunk.text.splitlines()]
    assert lines == [
        {"step": 7, "rank": 0, "scalars": {"loss": 2.5}},
        {"step": 8, "rank": 0, "scalars": {"loss": 2.0, "accuracy": 1.0}},
    ]


def test_tail_is_the_newest_bytes_from_a_line_start(tmp_path: Path) -> None:
    directory = job_dir(tmp_path, 5)
    record_ranks(directory, [0])
    log0 = directory / "worker-0.log"
    log0.write_text("".join(f"line {i:04d}\n" for i in range(100)))  # 1000 bytes
    tail = read_chunk(tmp_path, 5, tail=25)  # the last 25 bytes: half a line, then two
    assert tail.text == "line 0098\nline 0099\n"
    assert tail.offset == 980 and tail.next_offset == 1000 and tail.skipped_bytes == 0
    # After the cap cut the file, the tail's offsets are still logical.
    trim(tmp_path, max_bytes=600)
    again = read_chunk(tmp_path, 5, tail=20)
    assert again.text == "line 0098\nline 0099\n" and again.offset == 980
    # A tail longer than the file is all of it (what the cap kept).
    assert read_chunk(tmp_path, 5, tail=10_000).text.startswith("line 0070\n")
    assert read_chunk(tmp_path, 5, rank=1, tail=100).text == ""  # no such rank


def test_curve_is_each_steps_mean_over_every_worker_across_switches(tmp_path: Path) -> None:
    directory = job_dir(tmp_path, 6)
    record_ranks(directory, [0, 1])

    def write(worker: int, rows: list[tuple[int, int, dict[str, float]]]) -> None:
        with (directory / f"worker-{worker}.log.scalars").open("a") as fh:
            for step, rank, scalars in rows:
                fh.write(json.dumps({"step": step, "rank": rank, "scalars": scalars}) + "\n")

    # Two ranks (two micro-batches each on rank 0), then a switch to worker 2 alone.
    write(0, [(0, 0, {"loss": 4.0}), (0, 0, {"loss": 2.0}), (1, 0, {"loss": 2.0, "lr": 0.1})])
    write(1, [(0, 1, {"loss": 3.0}), (1, 1, {"loss": 1.0})])
    write(2, [(2, 0, {"loss": 0.5})])
    with (directory / "worker-2.log.scalars").open("a") as fh:
        fh.write('{"step": 3, "rank": 0, "scal')  # half written: skipped
    curve = scalar_curve(tmp_path, 6)
    assert curve.steps == [0, 1, 2] and curve.lines == 6
    assert curve.series == {"loss": [3.0, 1.5, 0.5], "lr": [None, 0.1, None]}
    # Thinned to at most 2 points: the newest step is kept.
    assert scalar_curve(tmp_path, 6, max_points=2).steps == [0, 2]
    assert scalar_curve(tmp_path, 99).steps == []  # a job with nothing logged
