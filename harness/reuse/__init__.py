"""Reuse assertions: expectations over cache statistics, checked against the oracle, and
the `expect_reuse` marker that states them on a test."""
