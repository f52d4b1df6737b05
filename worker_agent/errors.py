"""Errors of the worker agent: each carries the HTTP status its allocation API answers with."""

from __future__ import annotations


class AgentError(Exception):
    """An error the allocation API answers with `status_code` and this message."""

    status_code = 409


class StaleGeneration(AgentError):
    """A command older than the generation the job already applied."""


class SlotConflict(AgentError):
    """A slot the command names is held by another job."""


class JobGone(AgentError):
    """The job already finished, failed, or was stopped on this agent."""


class BadAllocation(AgentError):
    """The command cannot be applied as given (bad slots, no layout, bad workload)."""

    status_code = 422


class SwitchRejected(AgentError):
    """The hot switch failed and the job was rolled back to its old slots."""


class JobFailedError(AgentError):
    """The job's workers failed while applying the command."""

    status_code = 503


class JobCodeError(AgentError):
    """The job's own code failed to load (import error, missing function, wrong return type):
    the job is failed here and reported so in heartbeats (`job_error`)."""

    status_code = 422


class BundleUnavailable(AgentError):
    """The job's workdir bundle could not be fetched from the scheduler now (retry later)."""

    status_code = 503
