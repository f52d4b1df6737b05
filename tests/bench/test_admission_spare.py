"""bench/admission_spare.py runs and prints its shape (its speed is reported, never asserted)."""

from __future__ import annotations

from bench.admission_spare import measure


def test_the_spare_check_bench_measures_an_admitted_check() -> None:
    row = measure(12, repeat=1)
    assert row["held_deadline_jobs"] == 12 and row["slots"] == 288
    assert row["admitted"] is True
    assert isinstance(row["check_s"], float) and row["check_s"] >= 0.0
