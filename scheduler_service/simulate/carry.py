"""Re-plan on change: a replay step where nothing happened runs the plan in force, one slot on.

A replay calls its policy at every step (slot end, arrival, completion). Where a step ended at
its slot's end with no arrival and no completion, the plan in force already says what the next
slot runs; solving again from scratch mostly finds it again, at the cost of a whole solve. With
`SimulationConfig.replan = "on-change"` such a step keeps the plan, moved on by one slot, as long
as it still keeps its course: every deadline it met is still met, and no job's projected finish
moved later by more than half a slot (models or switch stalls that drifted from the plan's
expectation). Otherwise, and at every arrival, completion or budget period, the policy solves.
"""

from __future__ import annotations

from scheduler_service.allocation.heuristic import same_slot_length, shift_previous
from scheduler_service.allocation.problem import AllocationPlan, AllocationProblem, make_plan

# A carried plan may project a finish this share of a slot later than the plan it carries.
FINISH_DRIFT_SLOTS = 0.5


def carried_plan(
    problem: AllocationProblem, previous: AllocationPlan | None
) -> AllocationPlan | None:
    """The plan in force moved on one slot onto `problem`, if it still keeps its course (None:
    solve)."""
    if previous is None or not same_slot_length(previous, problem):
        return None
    moved_s = (problem.start_at - previous.start_at).total_seconds()
    if abs(moved_s - problem.slot_s) > 1e-6:
        return None
    if {job.job_id for job in problem.jobs} != set(previous.gpus):
        return None
    gpus = shift_previous(previous, problem)
    assert gpus is not None  # same slot length and one slot on
    plan = make_plan(
        problem,
        gpus,
        status=previous.status,
        policy=previous.policy,
        solve_s=0.0,
        step="carried",
    )
    for job_id, met in previous.deadline_met.items():
        if met and not plan.deadline_met.get(job_id, False):
            return None
    drift_s = FINISH_DRIFT_SLOTS * problem.slot_s
    for job_id, was_s in previous.completion_s.items():
        now_s = plan.completion_s.get(job_id)
        if was_s is not None and (now_s is None or now_s + moved_s > was_s + drift_s):
            return None
    return plan
