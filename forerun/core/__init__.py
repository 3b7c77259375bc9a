"""Scheduling without torch or processes: the KV block pool with prefix caching, `Scheduler`,
`AsyncScheduler` and the `SchedulerOutput` / `ModelRunnerOutput` data that crosses to the workers.
"""
