"""Hot switching of a job's parallel layout: plan (slice intersection) and execute (fused p2p)."""

from worker_agent.hotswitch.plan import (
    LocalCopy,
    PlanError,
    SwitchPlan,
    Transfer,
    build_plan,
)

__all__ = ["LocalCopy", "PlanError", "SwitchPlan", "Transfer", "build_plan"]
