"""Cluster-wide summary endpoint."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from scheduler_service.deps import SessionDep, UserOrOperator
from scheduler_service.exceptions import error_responses
from scheduler_service.jobs.repository import JobRepository
from scheduler_service.jobs.states import JobState
from scheduler_service.nodes.repository import NodeRepository

router = APIRouter(prefix="/v1", tags=["cluster"], responses=error_responses(401, 403))


class ClusterSummary(BaseModel):
    """GPUs and jobs at a glance."""

    gpus_total: int
    gpus_used: int
    gpus_free: int
    jobs_by_state: dict[JobState, int]


@router.get("/cluster")
def cluster_summary(session: SessionDep, _caller: UserOrOperator) -> ClusterSummary:
    """GPUs total/used and jobs by state."""
    total, used = NodeRepository(session).gpu_counts()
    counts = JobRepository(session).count_by_state()
    return ClusterSummary(
        gpus_total=total,
        gpus_used=used,
        gpus_free=total - used,
        jobs_by_state={state: counts.get(state.value, 0) for state in JobState},
    )
