"""Typed errors of the training runtime and the hot switch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker_agent.sharding import LayoutError

if TYPE_CHECKING:
    from worker_agent.runtime.switch import SwitchReport

__all__ = [
    "JobCodeFailed",
    "JobSpecError",
    "LayoutError",
    "RuntimeErrorBase",
    "SwitchFailed",
    "WorkerFailed",
]


class RuntimeErrorBase(Exception):
    """Base class for every error the runtime raises on purpose."""


class JobSpecError(RuntimeErrorBase, ValueError):
    """A job spec names an unknown preset or an entrypoint that cannot be loaded."""


class WorkerFailed(RuntimeErrorBase):
    """A worker process died or reported an error; the message names the worker and cause."""

    def __init__(self, message: str, dead: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.dead = dead
        """Ids of the workers whose process is gone."""


class JobCodeFailed(WorkerFailed):
    """The job's own definition failed in a worker (job module import, job function, its return
    value, the model factory): the job cannot run anywhere, so it fails instead of restarting."""


class SwitchFailed(RuntimeErrorBase):
    """A hot switch failed; the job was rolled back (see `recovered_from`)."""

    def __init__(
        self, message: str, recovered_from: str, report: SwitchReport | None = None
    ) -> None:
        super().__init__(message)
        self.recovered_from = recovered_from
        self.report = report
        """The failed attempt's report (timings, volumes, error)."""
