"""Per-job checkpoints on storage every agent can read, so a job survives the loss of its node.

Hot switches never touch disk; these checkpoints exist only for the case no in-memory state
survives: the node (or its agent) is gone, or a paused job resumes on another node. Layout:

    ROOT/job-<id>/step-<N>/rank<r>.pt      one file per worker of the layout at step N
    ROOT/job-<id>/step-<N>/manifest.json   written last: layout, step, workload fingerprint
    ROOT/job-<id>/LATEST                   name of the newest complete step directory

A checkpoint is visible only once LATEST names it (replaced atomically), so a crash while
writing leaves the previous one in force. Only the newest checkpoint is kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from worker_agent.protocol import WorkloadSpec
from worker_agent.runtime.runner import Checkpoint, JobRunner
from worker_agent.sharding import Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredCheckpoint:
    """A complete checkpoint of one job: where its files are and what they hold."""

    job_id: int
    step: int
    layout: Layout
    files: list[str]

    def runtime_checkpoint(self) -> Checkpoint:
        """The runtime's view (what `JobRunner.start(checkpoint=...)` loads, resharding)."""
        return Checkpoint(self.layout, self.step, list(self.files))


def workload_fingerprint(spec: WorkloadSpec) -> str:
    """What must match for a checkpoint to belong to this job (not an older job with its id)."""
    return spec.model_dump_json()


class CheckpointStore:
    """Save and find the newest checkpoint of each job under one shared directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _job_dir(self, job_id: int) -> Path:
        return self.root / f"job-{job_id}"

    def latest(self, job_id: int, spec: WorkloadSpec) -> StoredCheckpoint | None:
        """The newest complete checkpoint of this job's workload, or None."""
        job_dir = self._job_dir(job_id)
        try:
            name = (job_dir / "LATEST").read_text().strip()
            manifest = json.loads((job_dir / name / "manifest.json").read_text())
        except (OSError, ValueError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("job %d: unreadable checkpoint in %s: %s", job_id, job_dir, exc)
            return None
        if manifest.get("workload") != workload_fingerprint(spec):
            log.warning("job %d: checkpoint in %s is of another workload; ignored", job_id, job_dir)
            return None
        files = [str(job_dir / name / f) for f in manifest["files"]]
        if not all(Path(f).is_file() for f in files):
            log.warning("job %d: checkpoint %s lacks files; ignored", job_id, job_dir / name)
            return None
        layout = Layout(**manifest["layout"])
        return StoredCheckpoint(job_id, int(manifest["step"]), layout, files)

    def save(self, job_id: int, spec: WorkloadSpec, runner: JobRunner) -> StoredCheckpoint:
        """Write the runner's state (its driver must be paused) and make it the latest."""
        job_dir = self._job_dir(job_id)
        job_dir.mkdir(parents=True, exist_ok=True)
        step = runner.step_progress().step
        name = f"step-{step}"
        target = job_dir / name
        staging = job_dir / f".{name}.{os.getpid()}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        saved = runner.save_checkpoint(str(staging))
        files = [Path(f).name for f in saved.files]
        manifest = {
            "job_id": job_id,
            "step": saved.step,
            "layout": {"dp": saved.layout.dp, "tp": saved.layout.tp, "pp": saved.layout.pp},
            "files": files,
            "workload": workload_fingerprint(spec),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        pointer = job_dir / ".LATEST.tmp"
        pointer.write_text(name)
        os.replace(pointer, job_dir / "LATEST")
        for old in job_dir.iterdir():
            if old.is_dir() and old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        return StoredCheckpoint(job_id, saved.step, saved.layout, [str(target / f) for f in files])

    def remove(self, job_id: int) -> None:
        """Delete a finished job's checkpoints."""
        shutil.rmtree(self._job_dir(job_id), ignore_errors=True)
