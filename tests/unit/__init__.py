"""Unit tests: cache core, model, engine, checkpoints, the benchmark report."""
