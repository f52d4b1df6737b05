"""Training runtime: jobs, presets, layouts, worker processes and the parent-side JobRunner.

Import from the submodules (`worker_agent.runtime.runner.JobRunner`, `.layout.choose_layout`,
`.presets.JobSpec`, `.job.TrainingJob`). The runtime imports `worker_agent.hotswitch`; both import
the shared geometry in `worker_agent.sharding`, and the hot switch imports nothing from here.
"""
