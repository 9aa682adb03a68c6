"""Tests of harness.reuse: the reuse assertions and the expect_reuse marker."""
