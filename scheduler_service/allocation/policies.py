"""The policy registry shared by the simulator and the live service."""

from __future__ import annotations

from typing import Protocol

from scheduler_service.allocation.baselines import (
    carbon_agnostic,
    carbon_greedy,
    static_fcfs,
    temporal_shift,
)
from scheduler_service.allocation.guarded import greenflow
from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem
from scheduler_service.allocation.stalls import with_stalls
from scheduler_service.allocation.team_budgets import with_team_budgets


class Policy(Protocol):
    """A pure function from one tick's problem to a plan."""

    def __call__(
        self,
        problem: AllocationProblem,
        *,
        previous: AllocationPlan | None,
        time_limit_s: float,
        seed: int,
    ) -> AllocationPlan: ...


POLICIES: dict[str, Policy] = {
    # The solver, guarded by deadline-safe candidates (see guarded.py).
    "greenflow": greenflow,
    "carbon-agnostic": carbon_agnostic,
    "static": static_fcfs,
    "carbon-greedy": carbon_greedy,
    "shift": temporal_shift,
}

# Policies that decide admission at submission (ElasticFlow semantics); the others admit all.
ADMISSION_CONTROL: frozenset[str] = frozenset({"greenflow", "carbon-agnostic"})


class UnknownPolicy(ValueError):
    """No policy of that name (the message lists the known ones)."""


def get_policy(name: str) -> Policy:
    """The policy registered under `name`, its plans held to the teams' hard budgets
    (team_budgets.py) and padded for switch stalls (stalls.py)."""
    try:
        return with_stalls(with_team_budgets(POLICIES[name]))
    except KeyError:
        raise UnknownPolicy(
            f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None
