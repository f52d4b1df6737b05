"""A plan's per-job rows and per-slot totals, derived once when the plan is stored (the GPUs per
job and slot are stored only as `plan_jobs` rows), and read back whole."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import zip_longest
from typing import Any

from scheduler_service.db.models import Plan, PlanJob

# A plan's JSON column that grows with slots: readers of one job, one user or the per-slot
# totals skip it (deferred) and read `plan_jobs` and `total_gpus` instead.
PLAN_BULK_COLUMNS = (Plan.slots,)


def total_gpus_per_slot(gpus_by_job: Mapping[str, Sequence[int]], num_slots: int) -> list[int]:
    """GPUs planned in each slot summed over jobs (as long as the plan's longest row)."""
    # Column sums over the rows (zip_longest pads the short ones): a Python loop over every
    # job x slot took half a second of each tick at 5,000 jobs.
    totals = [sum(column) for column in zip_longest(*gpus_by_job.values(), fillvalue=0)]
    return totals + [0] * (num_slots - len(totals))


def trimmed(gpus: Sequence[int]) -> list[int]:
    """A job's GPUs per slot without the trailing zeros (the stored form), but at least its
    first slot: an empty row is a job the plan names only for its missed deadline."""
    if not any(gpus):
        # Most rows after a burst (deferred jobs): checked in C, not slot by slot in Python.
        return list(gpus[:1])
    end = len(gpus)
    while end > 1 and not gpus[end - 1]:
        end -= 1
    return list(gpus[:end])


def padded(gpus: Sequence[int], num_slots: int) -> list[int]:
    """A stored row back at the plan's length (its trailing zeros restored)."""
    return [*gpus, *([0] * (num_slots - len(gpus)))]


def plan_job_values(
    gpus_by_job: Mapping[str, Sequence[int]], deadline_misses: Mapping[str, str]
) -> list[dict[str, Any]]:
    """The column values of one row per job the plan names (given GPUs or a missed deadline)."""
    return [
        {
            "job_id": int(job_id),
            "gpus": trimmed(gpus_by_job.get(job_id, ())),
            "deadline_miss": deadline_misses.get(job_id),
        }
        for job_id in sorted({*gpus_by_job, *deadline_misses}, key=int)
    ]


def index_plan(
    plan: Plan, gpus_by_job: Mapping[str, Sequence[int]], deadline_misses: Mapping[str, str]
) -> Plan:
    """Fill a new plan's slot count, per-slot totals and per-job rows (to add it as objects;
    `AllocationRepository.add_plan` writes the rows faster)."""
    index_totals(plan, gpus_by_job)
    plan.jobs = [PlanJob(**values) for values in plan_job_values(gpus_by_job, deadline_misses)]
    return plan


def index_totals(plan: Plan, gpus_by_job: Mapping[str, Sequence[int]]) -> Plan:
    """Fill a new plan's slot count and per-slot totals."""
    plan.num_slots = len(plan.slots or [])
    plan.total_gpus = total_gpus_per_slot(gpus_by_job, plan.num_slots)
    return plan


def plan_contents(
    rows: Sequence[PlanJob], num_slots: int
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """A stored plan's GPUs per job and slot (at the plan's length) and its deadline misses,
    as the solver's plan had them, from its per-job rows."""
    gpus = {str(row.job_id): padded(row.gpus, num_slots) for row in rows if row.gpus}
    misses = {str(row.job_id): row.deadline_miss for row in rows if row.deadline_miss is not None}
    return gpus, misses
