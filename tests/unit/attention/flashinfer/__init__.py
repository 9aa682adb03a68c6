"""Tests of the FlashInfer backend that run without CUDA (kvcache.attention.flashinfer)."""
