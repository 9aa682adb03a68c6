"""Tests of harness.repro: both kinds of repro record, written by failing tests and replayed."""
