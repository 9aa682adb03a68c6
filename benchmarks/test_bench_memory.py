"""Memory: Python heap per cached block (the manager's bookkeeping) and KV bytes per token.

Heap: tracemalloc counts every allocation the manager makes while it caches the design's
two cache-core workloads (admit, commit, free each request; nothing evicted). The empty
manager (its free list) is measured first and reported per pool block; what caching
adds is reported per cached block and per cached token. The prompts are built before
tracing, so only the manager's own memory counts. The time recorded for these tests is
one traced fill, slowed by tracemalloc: the numbers are in extra_info.

KV storage: bytes one token's K and V occupy across the tiny model's layers, read from
the allocated tensors and checked against KvStorage.nbytes_per_token.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pytest
import torch

from benchmarks.report_format import Section, by_suite, table
from harness.reports.bench_results import Benchmark
from harness.workloads import bench_multi_turn_chat, bench_shared_prompt
from kvcache import KvCacheConfig, KvCacheManager
from kvcache.model import get_preset
from kvcache.storage.kv_storage import KvStorage

B = 16
WORKLOADS: dict[str, Callable[[], list[list[int]]]] = {
    "shared_prompt": bench_shared_prompt,
    "multi_turn": bench_multi_turn_chat,
}
QUICK_REQUESTS = 200
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


class HeapUse(NamedTuple):
    """Traced bytes of an empty manager and what caching the workload added."""

    pool_blocks: int
    empty_bytes: int
    added_bytes: int
    cached_blocks: int
    tree_nodes: int

    @property
    def bytes_per_cached_block(self) -> float:
        return self.added_bytes / self.cached_blocks


def traced_fill(prompts: list[list[int]]) -> HeapUse:
    """Build a manager under tracemalloc and cache `prompts` in it (admit, commit, free)."""
    pool = sum(-(-len(p) // B) for p in prompts) + 64
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        mgr = KvCacheManager(KvCacheConfig(tokens_per_block=B, max_num_blocks=pool,
                                           enable_block_reuse=True))
        empty = tracemalloc.get_traced_memory()[0] - base
        for i, p in enumerate(prompts):
            mgr.add_sequence(i, p)
            mgr.take_copy_ops()  # an engine applies them before the forward pass it commits
            mgr.commit(i, len(p))
            mgr.free_sequence(i)
        gc.collect()
        added = tracemalloc.get_traced_memory()[0] - base - empty
    finally:
        tracemalloc.stop()
    assert mgr.leak_report() == [], mgr.leak_report()
    stats = mgr.stats()
    assert stats.evicted_blocks == 0, "the pool is sized so that nothing is evicted"
    return HeapUse(pool, empty, added, stats.cached_num_blocks, mgr.state.tree.num_nodes)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_heap_per_cached_block(benchmark: Any, bench_quick: bool, workload: str) -> None:
    prompts = WORKLOADS[workload]()
    if bench_quick:
        prompts = prompts[:QUICK_REQUESTS]
    use = benchmark.pedantic(traced_fill, args=(prompts,), rounds=1)
    kv_block_fp16 = tiny_storage(torch.float16, 1).nbytes_per_token * B
    benchmark.extra_info.update(
        suite="memory", kind="heap", workload=workload, requests=len(prompts),
        block_size=B, pool_blocks=use.pool_blocks, cached_blocks=use.cached_blocks,
        tree_nodes=use.tree_nodes, empty_manager_bytes=use.empty_bytes,
        bytes_per_pool_block=round(use.empty_bytes / use.pool_blocks, 2),
        heap_bytes_added=use.added_bytes,
        bytes_per_cached_block=round(use.bytes_per_cached_block, 2),
        bytes_per_cached_token=round(use.bytes_per_cached_block / B, 3),
        heap_to_tiny_fp16_kv=round(use.bytes_per_cached_block / kv_block_fp16, 5))


def tiny_storage(dtype: torch.dtype, num_blocks: int) -> KvStorage:
    """KV storage shaped for the tiny model, as the engine allocates it."""
    mc = get_preset("tiny")
    return KvStorage(num_layers=len(mc.attention_layers), num_blocks=num_blocks, block_size=B,
                     num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_bytes_per_token(benchmark: Any, dtype: torch.dtype) -> None:
    """KV storage of the tiny model: bytes per token, measured from the tensors."""
    mc = get_preset("tiny")
    num_blocks = 64
    storage = benchmark.pedantic(tiny_storage, args=(dtype, num_blocks), rounds=3)
    measured = sum(t.numel() * t.element_size() for t in (*storage.k, *storage.v))
    per_token = measured / (num_blocks * B)
    assert per_token == storage.nbytes_per_token
    benchmark.extra_info.update(
        suite="memory", kind="kv", model="tiny", dtype=str(dtype).removeprefix("torch."),
        layers=storage.num_layers, kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        block_size=B, bytes_per_token=per_token, bytes_per_block=per_token * B)


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --


def _memory(benches: Sequence[Benchmark]) -> list[str]:
    heap = [b.extra for b in benches if b.extra.get("kind") == "heap"]
    kv = [b.extra for b in benches if b.extra.get("kind") == "kv"]
    lines = ["## Memory", ""]
    if heap:
        lines += ["Python heap of the manager (tracemalloc), design workloads:", "",
                  *table(["workload", "cached blocks", "bytes / cached block",
                          "bytes / cached token", "empty manager bytes / pool block",
                          "heap / tiny fp16 KV block"],
                         [[e.get("workload"), e.get("cached_blocks"),
                           e.get("bytes_per_cached_block"), e.get("bytes_per_cached_token"),
                           e.get("bytes_per_pool_block"), e.get("heap_to_tiny_fp16_kv")]
                          for e in heap])]
    if kv:
        lines += ["KV storage of the tiny model:", "",
                  *table(["dtype", "bytes / token", "bytes / block"],
                         [[e.get("dtype"), e.get("bytes_per_token"), e.get("bytes_per_block")]
                          for e in kv])]
    return lines


SECTIONS = (
    Section("Memory", by_suite("memory"), _memory),
)
