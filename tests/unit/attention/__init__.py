"""Attention tests: metadata, reference and FlashInfer backends against a dense oracle."""
