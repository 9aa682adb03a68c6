"""Tests of harness.oracle: the oracles, the checked manager, the after-test checks, kv_index."""
