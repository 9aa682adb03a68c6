"""Paged decode metadata and reference attention, each next to its ideal.

Metadata: decode batches at a 4k-token context (uniform, or ragged over [3.5k, 4k)), block
16. `test_decode_step_metadata` times what the engine does each decode step: a
PersistentBatch advancing its requests by one token; each round is one page cycle (16
steps, in which every request starts exactly one new page), timed after an untimed
admission and first step, and reported per step; `rebuild_us` is the step after the
middle request leaves and joins again, `rejoin_cycle_us` the page cycle that step begins,
per step (on fresh batches). `test_build_decode_metadata` times the
full rebuild from the block table (build_metadata, the reference).
`test_decode_step_metadata_windowed` runs the same page cycle under a sliding window of
half the context (ragged contexts): each request also releases its first block once per
cycle (BlockTable.drop_front), and the step is either the PersistentBatch's (release_front
included) or a rebuild from the table, which windowed engines ran before. The ideal is one torch
copy_ of the final int32 kv_indices (the least any step must touch), timed in the same
run. Attention: the torch reference backend against dense masked attention over the
same K/V without paging. Each measured test records its baseline and ratio in
extra_info. One torch thread, as in the other CPU suites: on a shared 2-core VM a
two-thread copy_ of a few hundred KB stalls on the other thread for 10x its median.
"""

from __future__ import annotations

import math
import statistics
import time
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.report_format import Section, by_base, div, duration, ratio, table
from harness.reports.bench_results import Benchmark
from kvcache.attention import BlockTable, PersistentBatch, build_metadata
from kvcache.attention.reference import ReferenceBackend
from kvcache.storage.kv_storage import KvStorage

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT, BLOCK = 4096, 16
BATCHES = [pytest.param(b, id=f"b{b}") for b in (1, 8, 64, 256)]
STEPS_PER_ROUND = BLOCK  # one page cycle: every request starts one new page


def _median_us(fn: Callable[[], Any], number: int = 200, repeat: int = 15) -> float:
    runs = timeit.Timer(fn).repeat(repeat=repeat, number=number)
    return statistics.median(runs) / number * 1e6


def _record_ratio(benchmark: Any, baseline_us: float) -> None:
    benchmark.extra_info["baseline_us"] = round(baseline_us, 3)
    if benchmark.stats is not None:  # absent under --benchmark-disable
        median_us = benchmark.stats.stats.median * 1e6
        benchmark.extra_info["ratio"] = round(median_us / baseline_us, 2)


def _decode_batch(batch: int, ragged: bool) -> tuple[BlockTable, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    width = CONTEXT // BLOCK + 4  # room for two page cycles of decode steps, and then some
    table = BlockTable(batch * 2, width)
    slots = rng.permutation(batch * 2)[:batch]
    for slot in slots.tolist():
        table.assign(slot, rng.integers(0, 1 << 20, width).tolist())
    cached = (rng.integers(CONTEXT * 7 // 8, CONTEXT, batch) if ragged
              else np.full(batch, CONTEXT - 1))
    return table, slots, cached, np.ones(batch, dtype=np.int64)


def _bench_build(benchmark: Any, batch: int, ragged: bool) -> None:
    table, slots, cached, new = _decode_batch(batch, ragged)

    def build() -> Any:
        return build_metadata(table, slots, cached, new, block_size=BLOCK)

    md = benchmark(build)
    final = md.kv_indices.clone()
    dst = torch.empty_like(final)
    benchmark.extra_info.update(batch=batch, context=CONTEXT, block_size=BLOCK,
                                ragged=ragged, nnz_pages=final.numel())
    _record_ratio(benchmark, _median_us(lambda: dst.copy_(final)))


@pytest.mark.parametrize("batch", BATCHES)
def test_build_decode_metadata(benchmark: Any, batch: int) -> None:
    _bench_build(benchmark, batch, ragged=False)


@pytest.mark.parametrize("batch", [pytest.param(256, id="b256")])
def test_build_decode_metadata_ragged(benchmark: Any, batch: int) -> None:
    """Contexts spread over [3.5k, 4k): kv_indices needs a ragged gather."""
    _bench_build(benchmark, batch, ragged=True)


def _admitted(table: BlockTable, slots: np.ndarray, cached: np.ndarray) -> PersistentBatch:
    """A batch of the requests after its first step and a page cycle of decode steps (in
    which every request starts a page, so the batch knows which do at which step)."""
    batch = PersistentBatch(table, block_size=BLOCK)
    for slot, c in zip(slots.tolist(), cached.tolist(), strict=True):
        batch.add(slot, c)
    for _ in range(STEPS_PER_ROUND + 1):
        batch.step()
    return batch


def _rejoin_seconds(table: BlockTable, slots: np.ndarray, cached: np.ndarray,
                    repeat: int = 9) -> tuple[float, float]:
    """Medians, over `repeat` fresh batches (each as `_admitted`, so the table never
    runs out of blocks however many), of the decode step after the middle request leaves
    and joins again (compaction runs in the join, untimed) and of the steps of the page
    cycle it begins, per step: the counters and phase plans patched, then the steps,
    their page starts included."""
    first, cycle = [], []
    for _ in range(repeat):
        pb = _admitted(table, slots, cached)
        pb.step()  # off the phase at which every uniform request starts a page
        slot = pb.slots[len(slots) // 2]
        kv = pb.kv_len(slot)
        pb.remove(slot)
        pb.add(slot, kv)
        start = time.perf_counter()
        pb.step()
        first.append(time.perf_counter() - start)
        for _ in range(STEPS_PER_ROUND - 1):
            pb.step()
        cycle.append((time.perf_counter() - start) / STEPS_PER_ROUND)
    return statistics.median(first), statistics.median(cycle)


@pytest.mark.parametrize(("batch", "ragged"), [
    *(pytest.param(b, False, id=f"b{b}") for b in (1, 8, 64, 256)),
    *(pytest.param(b, True, id=f"b{b}-ragged") for b in (8, 64, 256)),
])
def test_decode_step_metadata(benchmark: Any, bench_quick: bool, batch: int,
                              ragged: bool) -> None:
    """Per step: a PersistentBatch's decode metadata, page starts included."""
    table, slots, cached, _ = _decode_batch(batch, ragged)
    last: list[PersistentBatch] = []

    def fresh() -> tuple[tuple[PersistentBatch], dict[str, Any]]:
        last[:] = [_admitted(table, slots, cached)]
        return (last[0],), {}

    def page_cycle(pb: PersistentBatch) -> None:
        for _ in range(STEPS_PER_ROUND):
            pb.step()

    benchmark.pedantic(page_cycle, setup=fresh, rounds=10 if bench_quick else 200)
    md = last[0].step()  # the state the last round left, one step on
    want = build_metadata(table, slots, cached + 2 * STEPS_PER_ROUND + 1,
                          np.ones(batch, np.int64), block_size=BLOCK)
    assert md.kv_indices.tolist() == want.kv_indices.tolist()
    assert md.positions.tolist() == want.positions.tolist()
    final = md.kv_indices.clone()
    dst = torch.empty_like(final)
    baseline_us = _median_us(lambda: dst.copy_(final))
    rebuild, rejoin_cycle = _rejoin_seconds(table, slots, cached)
    benchmark.extra_info.update(batch=batch, context=CONTEXT, block_size=BLOCK, ragged=ragged,
                                nnz_pages=final.numel(), steps_per_round=STEPS_PER_ROUND,
                                baseline_us=round(baseline_us, 3),
                                rebuild_us=round(rebuild * 1e6, 2),
                                rejoin_cycle_us=round(rejoin_cycle * 1e6, 3))
    if benchmark.stats is not None:  # absent under --benchmark-disable
        step_us = benchmark.stats.stats.median * 1e6 / STEPS_PER_ROUND
        benchmark.extra_info.update(step_us=round(step_us, 3), ratio=round(step_us / baseline_us, 2))


WINDOW = CONTEXT // 2  # a multiple of BLOCK


def _due(slots: np.ndarray, kv: np.ndarray) -> list[list[int]]:
    """For each step of a page cycle from kv tokens, the slots whose first block leaves
    the window before it: before position p a row starts at block (p - WINDOW + 1) // BLOCK."""
    return [slots[(kv + s - WINDOW + 1) % BLOCK == 0].tolist() for s in range(STEPS_PER_ROUND)]


def _windowed_round(table: BlockTable, slots: np.ndarray, cached: np.ndarray,
                    batch_mode: bool) -> tuple[BlockTable, PersistentBatch | None, list[list[int]]]:
    """A fresh copy of `table` whose rows released every block before the window of
    their next token, a batch over it (batch_mode) after its first step and an untimed
    page cycle (as `_admitted`), and the next cycle's releases (see _due). Both modes
    leave the table at cached + 1 + STEPS_PER_ROUND tokens a row."""
    fresh = BlockTable(table.max_slots, table.max_blocks_per_slot)
    fresh.blocks[:] = table.blocks
    fresh.lengths[:] = table.lengths
    for slot, n in zip(slots.tolist(), cached.tolist(), strict=True):
        fresh.drop_front(slot, max(0, n - WINDOW + 1) // BLOCK)
    pb = PersistentBatch(fresh, block_size=BLOCK) if batch_mode else None
    if pb is not None:
        for slot, c in zip(slots.tolist(), cached.tolist(), strict=True):
            pb.add(slot, c)
        pb.step()
    for released in _due(slots, cached + 1):
        for slot in released:
            fresh.drop_front(slot, 1)
            if pb is not None:
                pb.release_front(slot)
        if pb is not None:
            pb.step()
    return fresh, pb, _due(slots, cached + 1 + STEPS_PER_ROUND)


@pytest.mark.parametrize("mode", ["step", "rebuild"])
@pytest.mark.parametrize("batch", [pytest.param(b, id=f"b{b}") for b in (64, 256)])
def test_decode_step_metadata_windowed(benchmark: Any, bench_quick: bool, batch: int,
                                       mode: str) -> None:
    """Per step under a window: front releases, then the step's decode metadata."""
    table, slots, cached, ones = _decode_batch(batch, ragged=True)
    state: list[Any] = []

    def fresh() -> tuple[tuple[()], dict[str, Any]]:
        state[:] = _windowed_round(table, slots, cached, mode == "step")
        return (), {}

    def page_cycle_step() -> None:
        table, pb, due = state
        assert pb is not None
        for released in due:
            for slot in released:
                table.drop_front(slot, 1)
                pb.release_front(slot)
            pb.step()

    def page_cycle_rebuild() -> None:
        table, _, due = state
        kv = cached + 1 + STEPS_PER_ROUND
        for released in due:
            for slot in released:
                table.drop_front(slot, 1)
            build_metadata(table, slots, kv, ones, block_size=BLOCK)
            kv += 1

    benchmark.pedantic(page_cycle_step if mode == "step" else page_cycle_rebuild,
                       setup=fresh, rounds=10 if bench_quick else 100)
    if mode == "step":  # the state the last round left, one step on
        md = state[1].step()
        want = build_metadata(state[0], slots, cached + 2 * STEPS_PER_ROUND + 1, ones,
                              block_size=BLOCK)
        for name in ("kv_indices", "kv_indptr", "kv_lens", "positions", "kv_start"):
            assert getattr(md, name).tolist() == getattr(want, name).tolist(), name
    benchmark.extra_info.update(batch=batch, context=CONTEXT, block_size=BLOCK, ragged=True,
                                window=WINDOW, mode=mode, steps_per_round=STEPS_PER_ROUND)
    if benchmark.stats is not None:
        benchmark.extra_info["step_us"] = round(
            benchmark.stats.stats.median * 1e6 / STEPS_PER_ROUND, 3)


@pytest.mark.parametrize("batch", BATCHES)
def test_copy_kv_indices_baseline(benchmark: Any, batch: int) -> None:
    md = build_metadata(*_decode_batch(batch, ragged=False), block_size=BLOCK)
    final = md.kv_indices.clone()
    dst = torch.empty_like(final)
    benchmark(dst.copy_, final)
    benchmark.extra_info.update(batch=batch, context=CONTEXT, nnz_pages=final.numel())


# Attention: 4 requests, 256 cached + 128 new tokens each, GQA 8/2, head_dim 64, fp32.
REQUESTS, CACHED, NEW, HQ, HKV, D = 4, 256, 128, 8, 2, 64


def _attention_setup() -> tuple[ReferenceBackend, list[torch.Tensor], Callable[[], Any]]:
    gen = torch.Generator().manual_seed(0)
    kv_len = CACHED + NEW
    blocks = kv_len // BLOCK
    storage = KvStorage(num_layers=1, num_blocks=REQUESTS * blocks, block_size=BLOCK,
                        num_kv_heads=HKV, head_dim=D)
    table = BlockTable(REQUESTS, blocks)
    perm = torch.randperm(REQUESTS * blocks, generator=gen).tolist()
    for r in range(REQUESTS):
        table.assign(r, perm[r * blocks:(r + 1) * blocks])
    md = build_metadata(table, list(range(REQUESTS)), [CACHED] * REQUESTS, [NEW] * REQUESTS,
                        block_size=BLOCK)
    backend = ReferenceBackend(storage=storage, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    backend.plan(md)
    T = REQUESTS * NEW
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (HQ, HKV, HKV))
    keys = [torch.randn(kv_len, HQ, D, generator=gen).transpose(0, 1) for _ in range(REQUESTS)]
    values = [torch.randn(kv_len, HQ, D, generator=gen).transpose(0, 1) for _ in range(REQUESTS)]
    # Bottom-right causal mask (SDPA's is_causal is top-left aligned when q_len != kv_len).
    visible = torch.ones(NEW, kv_len, dtype=torch.bool).tril(diagonal=kv_len - NEW)
    qs = q.view(REQUESTS, NEW, HQ, D).transpose(1, 2)

    def dense() -> list[torch.Tensor]:
        return [torch.nn.functional.scaled_dot_product_attention(
            qs[r], keys[r], values[r], attn_mask=visible, scale=1 / math.sqrt(D))
            for r in range(REQUESTS)]

    return backend, [q, k, v], dense


def test_reference_attention(benchmark: Any) -> None:
    backend, (q, k, v), dense = _attention_setup()
    benchmark(backend.forward, 0, q, k, v)
    benchmark.extra_info.update(requests=REQUESTS, cached=CACHED, new=NEW, num_qo_heads=HQ,
                                num_kv_heads=HKV, head_dim=D, block_size=BLOCK)
    _record_ratio(benchmark, _median_us(dense, number=5, repeat=7))


def test_dense_attention_baseline(benchmark: Any) -> None:
    _, _, dense = _attention_setup()
    benchmark(dense)
    benchmark.extra_info.update(requests=REQUESTS, cached=CACHED, new=NEW, num_qo_heads=HQ,
                                num_kv_heads=HKV, head_dim=D)


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --

METADATA_TARGET = 4.0  # the decode metadata costs at most 4 copy_'s of kv_indices


def _metadata(benches: Sequence[Benchmark]) -> list[str]:
    rows = []
    for b in sorted(benches, key=lambda b: (not b.base.startswith("test_decode_step"),
                                            b.extra.get("ragged", False), b.extra.get("batch", 0))):
        if b.base == "test_copy_kv_indices_baseline":
            continue
        e = b.extra
        per_step = b.median / e.get("steps_per_round", 1)  # seconds per step (or build)
        path = e.get("mode") or ("step" if b.base.startswith("test_decode_step") else "rebuild")
        if e.get("window"):
            path += f", window {e['window']}"
        rows.append([path, e.get("batch", "?"), "yes" if e.get("ragged") else "no",
                     e.get("context", "?"), duration(per_step),
                     duration(div(e.get("baseline_us"), 1e6)),
                     ratio(div(per_step * 1e6, e.get("baseline_us")) or e.get("ratio")),
                     duration(div(e.get("rebuild_us"), 1e6)) if "rebuild_us" in e else ""])
    return [f"## Decode metadata against one copy_ of kv_indices (target <= "
            f"{METADATA_TARGET:g}x)", "",
            "step: a PersistentBatch's decode step (what the engine runs; page starts "
            "included, per step of a page cycle), and the step after a request leaves and "
            "another joins; rebuild: build_metadata from the block table (the reference). "
            "Window rows: each request also releases its first block once per page cycle "
            "(the table's drop_front, plus the batch's release_front in step).",
            "", *table(["path", "batch", "ragged", "context", "time", "copy_", "time / copy_",
                        "after leave + join"], rows)]


def _attention(benches: Sequence[Benchmark]) -> list[str]:
    rows = [[b.name, duration(b.median), ratio(b.extra.get("ratio"))]
            for b in benches if b.base == "test_reference_attention"]
    rows += [[b.name, duration(b.median), "1.00x"]
             for b in benches if b.base == "test_dense_attention_baseline"]
    return ["## Reference paged attention against dense attention", "",
            *table(["benchmark", "median", "vs dense"], rows)]


SECTIONS = (
    Section("Decode metadata", by_base("test_decode_step_metadata", "test_decode_step_metadata_windowed",
                     "test_build_decode_metadata", "test_build_decode_metadata_ragged",
                     "test_copy_kv_indices_baseline"), _metadata),
    Section("Reference paged attention", by_base("test_reference_attention", "test_dense_attention_baseline"), _attention),
)
