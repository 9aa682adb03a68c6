"""What the harness writes for people to read, and reads back to summarize: the run's
reuse report and the summary of a results folder (summary), the run record and its
outcome sections (run_record), the flake ledger over many runs (flakes), the
pytest-benchmark JSON reader both benchmark reports use (bench_results), and the one
escaping helper every markdown table goes through (markdown). Standard library only."""
