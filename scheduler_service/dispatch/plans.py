"""Per-job rows and per-slot totals of a plan, derived once when the plan is stored."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import zip_longest
from typing import Any

from scheduler_service.db.models import Plan, PlanJob

# A plan's JSON columns that grow with jobs x slots: readers of one job, one user or the per-slot
# totals skip them (deferred) and read `plan_jobs` and `total_gpus` instead.
PLAN_BULK_COLUMNS = (Plan.gpus_by_job, Plan.deadline_misses, Plan.slots)


def total_gpus_per_slot(gpus_by_job: Mapping[str, Sequence[int]], num_slots: int) -> list[int]:
    """GPUs planned in each slot summed over jobs (as long as the plan's longest row)."""
    # Column sums over the rows (zip_longest pads the short ones): a Python loop over every
    # job x slot took half a second of each tick at 5,000 jobs.
    totals = [sum(column) for column in zip_longest(*gpus_by_job.values(), fillvalue=0)]
    return totals + [0] * (num_slots - len(totals))


def plan_job_values(
    gpus_by_job: Mapping[str, Sequence[int]], deadline_misses: Mapping[str, str]
) -> list[dict[str, Any]]:
    """The column values of one row per job the plan names (given GPUs or a missed deadline)."""
    return [
        {
            "job_id": int(job_id),
            "gpus": list(gpus_by_job.get(job_id, ())),
            "deadline_miss": deadline_misses.get(job_id),
        }
        for job_id in sorted({*gpus_by_job, *deadline_misses}, key=int)
    ]


def plan_job_rows(
    gpus_by_job: Mapping[str, Sequence[int]], deadline_misses: Mapping[str, str]
) -> list[PlanJob]:
    """One row per job the plan names (given GPUs or a missed deadline)."""
    return [PlanJob(**values) for values in plan_job_values(gpus_by_job, deadline_misses)]


def index_totals(plan: Plan) -> Plan:
    """Fill a new plan's slot count and per-slot totals from its JSON columns."""
    plan.num_slots = len(plan.slots or [])
    plan.total_gpus = total_gpus_per_slot(plan.gpus_by_job or {}, plan.num_slots)
    return plan


def index_plan(plan: Plan) -> Plan:
    """Fill a new plan's slot count, per-slot totals and per-job rows from its JSON columns."""
    index_totals(plan)
    plan.jobs = plan_job_rows(plan.gpus_by_job or {}, plan.deadline_misses or {})
    return plan
