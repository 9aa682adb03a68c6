"""Engine tests: scheduler, step, generate(), CUDA graphs, the lock, the step timer (kvcache.engine)."""
