"""One-command reproduction of a failed scenario: the versioned repro file (fileformat),
what a scenario ran (workload), the failed check (record), how outputs differ (compare)
and the replay that re-runs the engine (rerun). `kvharness repro FILE` is the entry."""
