"""Reuse assertions: expectations over cache statistics, checked against the oracle, and
the `expect_reuse` marker that states them on a test; the engine protocol they read an
engine through (engine_protocol) and its adapter for kvcache's Engine (adapters)."""
