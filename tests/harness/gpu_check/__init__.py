"""Tests of harness.gpu_check, on CPU."""
