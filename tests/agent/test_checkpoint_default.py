"""Checkpoints are on by default, in the user's data directory, and never cross jobs."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from worker_agent.checkpoints import workload_fingerprint
from worker_agent.cli import default_checkpoint_dir
from worker_agent.protocol import WorkloadSpec


def test_default_checkpoint_dir_follows_xdg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_checkpoint_dir() == tmp_path / "greenflow" / "checkpoints"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_checkpoint_dir() == tmp_path / "home" / ".local/share/greenflow/checkpoints"


def test_a_job_with_the_same_id_and_workload_but_another_submission_is_another_job() -> None:
    def spec(at: datetime) -> WorkloadSpec:
        return WorkloadSpec(
            workload="gpt-tiny", global_batch_size=8, total_samples=64, seed=1, job_created_at=at
        )

    first, again = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 2, 1, tzinfo=UTC)
    assert workload_fingerprint(spec(first)) == workload_fingerprint(spec(first))
    assert workload_fingerprint(spec(first)) != workload_fingerprint(spec(again))
