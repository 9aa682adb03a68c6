"""GPU-only tests (marked `gpu`; skipped with a reason where CUDA is absent)."""
