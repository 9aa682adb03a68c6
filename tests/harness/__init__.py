"""Harness tests: lists, plugin, CLI, CI plumbing, oracle, reuse assertions, reports."""
