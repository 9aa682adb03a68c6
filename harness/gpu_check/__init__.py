"""The GPU check: one command that says whether this GPU runs the cache's attention right.

    python -m harness.gpu_check [--budget 480] [--stages smoke,engine] [--no-bench]
    nox -s gpu -- [same options]          ci/gpu_check.sh [same options]

In order, within a time budget (default 480 s, first-use kernel compilation included):
an environment smoke (versions, one decode plan), FlashInfer against the torch reference
in fp16, CUDA-graph replay on both decode kernels, the engine with graphs on against off,
bf16, sliding window and soft cap, then the GPU benchmarks while time is left (stages:
harness.gpu_check.stages). Writes results/gpu/report.md and report.json: per check the
outcome, seconds, its worst max-absolute-error against its tolerance and the kernel
families that ran, plus the versions and what was skipped and why. Without CUDA it prints
one line saying nothing ran, and exits 0.
"""

from __future__ import annotations

from harness.gpu_check.runner import main

__all__ = ["main"]
