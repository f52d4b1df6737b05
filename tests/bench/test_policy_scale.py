"""bench/policy_scale.py runs and prints its shape (its speed is reported, never asserted)."""

from __future__ import annotations

import json
import sys

import pytest

from bench import policy_scale


@pytest.mark.parametrize("deadlines", [True, False])
def test_the_policy_bench_reports_a_cold_and_a_warm_call(
    deadlines: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["policy_scale", "--cases", "30:16", "--slots", "24", "--time-limit-s", "0.05"]
    monkeypatch.setattr(sys, "argv", argv + ([] if deadlines else ["--no-deadlines"]))
    policy_scale.main()
    report = json.loads(capsys.readouterr().out)
    (case,) = report["cases"]
    assert (case["jobs"], case["gpus"]) == (30, 16)
    for call in ("cold", "warm"):
        assert case[call]["cpu_s"] >= 0.0 and case[call]["wall_s"] >= 0.0
        assert case[call]["deadline_misses"] >= 0
    assert report["setup"]["deadlines"] is deadlines and report["setup"]["slots"] == 24
