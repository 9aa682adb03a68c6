"""Storage layouts NHD, HND and BLHNC: per-step metadata build and block copies.

Geometry: 16 attention layers, 2 KV heads of 32 channels, fp16; manager blocks of 64
tokens read as kernel pages of 16 (k = 4), so the page index multiplier differs by
layout (NHD 4, HND 8, BLHNC 128). Decode batches of 1, 64 and 256 requests at a 4k
context. Metadata: one build_metadata per step, shared by every layer in all three
layouts. Copies: one partial-block copy (32 tokens, every layer) per request, as
copy-on-partial-reuse emits them. Both are compared with one copy_ of the step's
finished int32 kv_indices, timed in the same run; copies also with one copy_ of as many
contiguous bytes as they move (the memcpy floor). Ratios divide best times (the fastest
round against the fastest baseline run): on a shared machine the minimum is the figure
that load disturbs least. One intra-op thread throughout: a copy_ split over two threads
waits milliseconds for the second whenever the other core is busy.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.report_format import Section, by_suite, duration, ratio, table
from harness.reports.bench_results import Benchmark
from kvcache.attention import BlockTable, build_metadata
from kvcache.core.ops import BlockCopy
from kvcache.storage import LAYOUTS, KvLayout, KvStorage

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS, HEADS, HEAD_DIM, DTYPE = 16, 2, 32, torch.float16
BLOCK, PAGE, CONTEXT, COPY_TOKENS = 64, 16, 4096, 32
BATCHES = [pytest.param(b, id=f"b{b}") for b in (1, 64, 256)]
LAYOUT_PARAMS = [pytest.param(layout, id=layout.lower()) for layout in LAYOUTS]


def _best_us(fn: Callable[[], Any], number: int = 100, repeat: int = 15) -> float:
    return min(timeit.Timer(fn).repeat(repeat=repeat, number=number)) / number * 1e6


def _storage(layout: KvLayout, num_blocks: int, device: str = "cpu") -> KvStorage:
    return KvStorage(num_layers=LAYERS, num_blocks=num_blocks, block_size=BLOCK,
                     num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=DTYPE, device=device,
                     layout=layout)


def _decode_step(batch: int) -> tuple[BlockTable, np.ndarray, np.ndarray, np.ndarray, int]:
    """A persistent table of `batch` requests at CONTEXT tokens, and the pool size."""
    rng = np.random.default_rng(0)
    width = CONTEXT // BLOCK + 1
    num_blocks = batch * width
    table = BlockTable(batch, width)
    blocks = rng.permutation(num_blocks).reshape(batch, width)
    for slot in range(batch):
        table.assign(slot, blocks[slot].tolist())
    slots = np.arange(batch, dtype=np.int64)
    return table, slots, np.full(batch, CONTEXT - 1), np.ones(batch, dtype=np.int64), num_blocks


def _index_copy_us(kv_indices: torch.Tensor) -> float:
    final = kv_indices.clone()
    dst = torch.empty_like(final)
    return _best_us(lambda: dst.copy_(final))


def _record(benchmark: Any, layout: str, batch: int, baselines: dict[str, float],
            **extra: Any) -> None:
    benchmark.extra_info.update(suite="layouts", layout=layout, batch=batch, layers=LAYERS,
                                block_size=BLOCK, page_size=PAGE, context=CONTEXT,
                                torch_num_threads=torch.get_num_threads(), **extra)
    for name, us in baselines.items():
        benchmark.extra_info[f"{name}_us"] = round(us, 3)
        if benchmark.stats is not None:  # absent under --benchmark-disable
            ratio = benchmark.stats.stats.min * 1e6 / us
            benchmark.extra_info[f"ratio_to_{name}"] = round(ratio, 2)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_layout_metadata_build(benchmark: Any, layout: KvLayout, batch: int) -> None:
    table, slots, cached, new, num_blocks = _decode_step(batch)
    m = _storage(layout, num_blocks, device="meta").page_index_multiplier(PAGE)  # no memory

    def build() -> Any:
        return build_metadata(table, slots, cached, new, block_size=BLOCK, page_size=PAGE,
                              page_index_multiplier=m)

    md = benchmark(build)
    _record(benchmark, layout, batch, {"index_copy": _index_copy_us(md.kv_indices)},
            kind="metadata", multiplier=m, nnz_pages=md.kv_indices.numel())


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_layout_block_copies(benchmark: Any, layout: KvLayout, batch: int) -> None:
    storage = _storage(layout, 2 * batch)
    ops = [BlockCopy(2 * i, 2 * i + 1, COPY_TOKENS) for i in range(batch)]
    benchmark(storage.apply_copies, ops)
    moved = 2 * LAYERS * HEADS * HEAD_DIM * COPY_TOKENS * batch  # elements, K and V
    src, dst = torch.ones(moved, dtype=DTYPE), torch.empty(moved, dtype=DTYPE)
    table, slots, cached, new, _ = _decode_step(batch)
    md = build_metadata(table, slots, cached, new, block_size=BLOCK, page_size=PAGE,
                        page_index_multiplier=storage.page_index_multiplier(PAGE))
    _record(benchmark, layout, batch, {"index_copy": _index_copy_us(md.kv_indices),
                                       "memcpy": _best_us(lambda: dst.copy_(src), number=20)},
            kind="copies", tensors=len(storage.tensors), copied_bytes=moved * 2)


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --


def _layouts(benches: Sequence[Benchmark]) -> list[str]:
    by = {(b.extra["kind"], b.extra["layout"], int(b.extra["batch"])): b for b in benches}
    e = benches[0].extra
    lines = [f"## Storage layouts: metadata build and block copies ({e['layers']} layers, "
             f"blocks of {e['block_size']} read as pages of {e['page_size']}, "
             f"{e['context']}-token decode)", "",
             "Best of rounds (on a shared machine the least disturbed figure), against the "
             "best of one copy_ of the step's kv_indices (metadata, copies) and of one copy_ "
             "of the bytes the copies move (memcpy), timed in the same run.", ""]
    order = {"NHD": 0, "HND": 1, "BLHNC": 2}
    rows = []
    for layout, batch in sorted({k[1:] for k in by}, key=lambda k: (k[1], order.get(k[0], 3))):
        meta, copies = by.get(("metadata", layout, batch)), by.get(("copies", layout, batch))
        row: list[Any] = [layout, batch]
        row += ([meta.extra.get("multiplier", "?"), duration(meta.min),
                 ratio(meta.extra.get("ratio_to_index_copy"))] if meta else ["n/a"] * 3)
        row += ([copies.extra.get("tensors", "?"), duration(copies.min),
                 ratio(copies.extra.get("ratio_to_index_copy")),
                 ratio(copies.extra.get("ratio_to_memcpy"))] if copies else ["n/a"] * 4)
        rows.append(row)
    lines += table(["layout", "batch", "page multiplier", "metadata build", "build / copy_",
                    "tensors copied", "block copies", "copies / copy_", "copies / memcpy"],
                   rows)
    for batch in sorted({k[2] for k in by}):
        packed = by.get(("copies", "BLHNC", batch))
        per_layer = [b.min for b in (by.get(("copies", layout, batch)) for layout in
                                     ("NHD", "HND")) if b is not None]
        if packed is not None and per_layer:
            lines.append(f"- batch {batch}: packed block copies {ratio(min(per_layer) / packed.min)}"
                         f" faster than the fastest per-layer layout")
    return [*lines, ""]


SECTIONS = (
    Section("Storage layouts", by_suite("layouts"), _layouts),
)
