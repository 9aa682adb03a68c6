"""Tests of harness.plugin: selection, waives, isolation, leaks, change and shard selection, reruns."""
