"""Tests of harness.reports: the reuse report, the results summary, run records, flakes, markdown."""
