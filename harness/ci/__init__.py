"""The CI features the plugin and `kvharness` build on: time-sized shards, changed-file
selection, reruns that tell flaky from broken, the run record for job summaries, and the
flake ledger. Each pure module has its plugin glue beside it (`*_selection.py`)."""
