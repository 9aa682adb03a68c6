"""Reliability tests: faults, aborts, preemption, bad input, concurrency, isolation, fuzz."""
