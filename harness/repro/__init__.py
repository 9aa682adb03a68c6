"""One-command reproduction of a failed check, of either kind: the versioned repro file
and its limits (fileformat), what a file may name (registry), the reuse-check record
(reuse_record) and its replay on a fresh cache (reuse_replay), the scenario record
(scenario_record: what failed; workload: what the engines ran; compare: how outputs
differ) and its re-run of the engines (scenario_rerun). `replay` is the one way in
(`kvharness repro FILE`, and the plugin's writer); `outcome` the one answer."""
