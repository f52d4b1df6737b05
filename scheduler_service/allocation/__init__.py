"""Carbon-budgeted GPU allocation: problem data, the OR-Tools solver, baselines, policy registry."""
