"""The cache-core benchmark workloads through each adapter, side by side, in one process.

The workloads and phases of `benchmarks/test_bench_cache_core.py` (docs/design.md,
"Benchmark workloads and targets"): shared_prompt, multi_turn and random_tree, each
`insert` (admit, commit, free every request in order on a fresh cache) and `match` (the
same on a cache that has seen every request once), 16-token blocks, a pool the
workload fits in. Each runs through the engine's adapter and through kvcache's, in the
engine's worker, so both pay the same protocol (no event log, no router events) on the
same interpreter at the same time. Tokens per second of the best round.

This is the worker's half (`bench` request); the side-by-side table of `nox -s bench` is
the harness's (`harness.conform.controller.speed`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from harness.conform.protocol import CacheUnderTest, LoadedEngine
from harness.workloads import CACHE_BENCH_WORKLOADS

BLOCK = 16
WORKLOADS = CACHE_BENCH_WORKLOADS
PHASES = ("insert", "match")
QUICK_PROMPTS = 100  # a quick run's prompts per workload


class BenchRow(NamedTuple):
    """One (workload, phase, adapter): tokens and the best round's seconds."""

    workload: str
    phase: str
    adapter: str
    tokens: int
    seconds: float
    tokens_per_s: float


def _run(cache: CacheUnderTest, prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        seq = str(i)
        if cache.admit(seq, p, None, None) is None:
            raise RuntimeError(f"bench: request {i} was refused: the pool is sized to fit")
        cache.commit(seq, len(p))
        cache.free(seq)


def _timed(make: Callable[[int], CacheUnderTest], pool: int, prompts: list[list[int]],
           phase: str, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        cache = make(pool)
        if phase == "match":
            _run(cache, prompts)
        start = time.perf_counter()
        _run(cache, prompts)
        best = min(best, time.perf_counter() - start)
    return best


def run_bench(engine: LoadedEngine | None, quick: bool) -> list[BenchRow]:
    """Every workload and phase through `engine`'s adapter (None: kvcache's only) and
    kvcache's. Raises RuntimeError if an adapter refuses a request."""
    from harness.conform.adapters.kvcache import KvcacheCache

    adapters: list[tuple[str, Callable[[int], CacheUnderTest]]] = [
        ("kvcache", lambda n: KvcacheCache(n, BLOCK, record=False))]
    if engine is not None:
        new = engine.new
        adapters.append((f"{engine.name} {engine.version}", lambda n: new(n, BLOCK, False)))
    rows = []
    for workload, build in WORKLOADS.items():
        prompts = build()[:QUICK_PROMPTS] if quick else build()
        tokens = sum(map(len, prompts))
        pool = sum(-(-len(p) // BLOCK) for p in prompts) + 64
        for phase in PHASES:
            for name, make in adapters:
                seconds = _timed(make, pool, prompts, phase, 1 if quick else 2)
                rows.append(BenchRow(workload, phase, name, tokens, seconds, tokens / seconds))
    return rows

