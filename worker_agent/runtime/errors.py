"""Typed errors of the training runtime and the hot switch."""

from __future__ import annotations


class RuntimeErrorBase(Exception):
    """Base class for every error the runtime raises on purpose."""


class LayoutError(RuntimeErrorBase, ValueError):
    """A layout is invalid for the model, the batch size, or the GPU count."""


class JobSpecError(RuntimeErrorBase, ValueError):
    """A job spec names an unknown preset or an entrypoint that cannot be loaded."""


class WorkerFailed(RuntimeErrorBase):
    """A worker process died or reported an error; the message names the worker and cause."""

    def __init__(self, message: str, dead: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.dead = dead
        """Ids of the workers whose process is gone."""


class SwitchFailed(RuntimeErrorBase):
    """A hot switch failed; the job was rolled back (see `recovered_from`)."""

    def __init__(self, message: str, recovered_from: str) -> None:
        super().__init__(message)
        self.recovered_from = recovered_from
