"""Tests of harness.lists: the test-db reader, entries, waives, validation, machines."""
