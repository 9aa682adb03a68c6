"""Tests of the persistent decode batch (kvcache.attention.persistent)."""
