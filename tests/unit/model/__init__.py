"""Model tests: the transformer and HF checkpoints (kvcache.model)."""
