"""What a job's own code calls to report numbers: `greenflow_log(loss=..., accuracy=...)`.

    from worker_agent.joblog import greenflow_log

    def my_loss(model, batch):
        out = model(**batch)
        greenflow_log(loss=out.loss.item(), tokens=batch["input_ids"].numel())
        return out.loss

Each call appends one JSON line `{"step": S, "rank": R, "scalars": {...}}` to the calling
worker's scalars file on the agent (beside its captured stdout/stderr), tagged with the
optimizer step and the rank at that moment; `greenflow logs JOB --scalars` reads them back.
Outside a GreenFlow worker (a plain script) the call does nothing, so a job module stays
runnable on its own. Values must be numbers (bool, int, float); anything else is skipped.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from typing import IO

_lock = threading.Lock()
_sink: IO[str] | None = None
_where: Callable[[], tuple[int, int]] | None = None


def bind(path: str, where: Callable[[], tuple[int, int]]) -> None:
    """Send this process's scalars to `path`; `where()` gives (step, rank). Workers call it."""
    global _sink, _where
    with _lock:
        _sink = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (the process's life)
        _where = where


def unbind() -> None:
    """Stop recording (the calls become no-ops again)."""
    global _sink, _where
    with _lock:
        if _sink is not None:
            _sink.close()
        _sink, _where = None, None


def greenflow_log(**scalars: float) -> None:
    """Record named numbers for the current step (no-op outside a GreenFlow worker)."""
    with _lock:
        if _sink is None or _where is None:
            return
        step, rank = _where()
        values = {
            k: float(v)
            for k, v in scalars.items()
            if isinstance(v, int | float) and math.isfinite(float(v))
        }
        if values:
            _sink.write(json.dumps({"step": step, "rank": rank, "scalars": values}) + "\n")


log = greenflow_log
"""The same call by its short name: `from worker_agent import joblog; joblog.log(loss=...)`."""
