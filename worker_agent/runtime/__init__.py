"""Training runtime: jobs, presets, layouts, worker processes and the parent-side JobRunner.

Import from the submodules (`worker_agent.runtime.pool.JobRunner`, `.layout.Layout`,
`.presets.JobSpec`, `.job.TrainingJob`); this package imports nothing itself so that
`worker_agent.hotswitch` and the runtime can depend on each other's leaf modules.
"""
