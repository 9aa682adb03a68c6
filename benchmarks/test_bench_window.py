"""A long prompt on the sliding-window models, with and without early release.

`tiny-swa` (window 32) and `hybrid-tiny-swa` (the same window, layer 1 recurrent), blocks
of 16, a prompt 64 windows long (2,048 tokens; 16 windows, 512 tokens, in quick mode)
prefilled 256 tokens a step (128 quick), one token generated.
With release the engine runs in a pool of exactly the blocks the window and one chunk
span (`peak_blocks`); without it (`release_outside_window=False`) the pool must hold the
whole sequence. Each round builds both engines (untimed) and times one cold
`Engine.generate` on each, release on (the benchmark) and off (in the setup hook, so the
two alternate under the same machine load). KV memory is the storage each engine
allocates: pool blocks times the bytes of a block. "Most used" is the largest
`usedNumBlocks` seen at any forward pass of an untimed run (where a step peaks: its
chunk's blocks reserved, the blocks behind the window not yet released). Both runs must
produce the same token and logits (float32, 1e-5).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from benchmarks.conftest import quick_mode
from benchmarks.report_format import Section, by_suite, div, duration, ratio, table
from harness.reports.bench_results import Benchmark
from kvcache import Engine, KvCacheConfig
from kvcache.core.window import peak_blocks
from kvcache.engine import GenerationOutput
from kvcache.model import Transformer, get_preset

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PRESETS = ("tiny-swa", "hybrid-tiny-swa")
BLOCK = 16
TOL = 1e-5


def _engine(model: Transformer, release: bool, pool: int, chunk: int) -> Engine:
    cfg = KvCacheConfig(tokens_per_block=BLOCK, max_num_blocks=pool)
    return Engine(model, cfg, max_num_tokens=chunk, max_batch_size=1, record_events=False,
                  release_outside_window=release)


def _most_used(model: Transformer, release: bool, pool: int, chunk: int,
               prompt: list[int]) -> int:
    """The most blocks in use at any step of one run of `prompt`, read after each
    schedule (a step's peak: its admission or reservation is done, its forward not)."""
    engine = _engine(model, release, pool, chunk)
    most = 0
    schedule = engine.scheduler.schedule

    def watched() -> Any:
        nonlocal most
        scheduled = schedule()
        most = max(most, engine.manager.stats().used_num_blocks)
        return scheduled

    engine.scheduler.schedule = watched  # type: ignore[method-assign]
    engine.generate([prompt], 1)
    return most


@pytest.mark.parametrize("preset", PRESETS)
def test_window_long_prompt(benchmark: Any, pytestconfig: pytest.Config, preset: str) -> None:
    quick = quick_mode(pytestconfig)
    windows, chunk, rounds = (16, 128, 2) if quick else (64, 256, 5)
    model = Transformer(get_preset(preset), seed=0).eval()
    window = model.config.sliding_window
    assert window is not None
    prompt = random.Random(0).choices(range(1, model.config.vocab_size), k=windows * window)
    L = len(prompt)
    pools = {True: peak_blocks(L, L + 1, chunk, window - 1, BLOCK, reuse=True),
             False: -(-(L + 1) // BLOCK)}
    most = {r: _most_used(model, r, pools[r], chunk, prompt) for r in pools}
    assert all(0 < most[r] <= pools[r] for r in pools), (most, pools)
    block_bytes = _engine(model, True, pools[True], chunk).storage.nbytes_per_token * BLOCK
    off_times: list[float] = []
    outs: dict[bool, list[GenerationOutput]] = {True: [], False: []}

    def setup() -> tuple[tuple[Engine], dict[str, Any]]:
        off = _engine(model, False, pools[False], chunk)
        start = time.perf_counter()
        outs[False] += off.generate([prompt], 1)
        off_times.append(time.perf_counter() - start)
        return (_engine(model, True, pools[True], chunk),), {}

    def first_token(engine: Engine) -> None:
        outs[True].extend(engine.generate([prompt], 1))

    benchmark.pedantic(first_token, setup=setup, rounds=rounds, warmup_rounds=1)
    on, off = outs[True][0], outs[False][0]
    assert on.token_ids == off.token_ids
    assert on.logits is not None and off.logits is not None
    torch.testing.assert_close(on.logits, off.logits, rtol=TOL, atol=TOL)
    off_median = statistics.median(off_times[1:] or off_times)
    benchmark.extra_info.update(
        suite="window", model=preset, window=window, prompt_tokens=L, chunk_tokens=chunk,
        block_size=BLOCK, pool_blocks_release=pools[True], pool_blocks_keep=pools[False],
        kv_bytes_release=pools[True] * block_bytes, kv_bytes_keep=pools[False] * block_bytes,
        most_used_release=most[True], most_used_keep=most[False],
        keep_median_s=off_median)
    if benchmark.stats is not None:
        benchmark.extra_info["keep_over_release"] = off_median / benchmark.stats.stats.median


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --


def _window(benches: Sequence[Benchmark]) -> list[str]:
    lines = ["## Sliding window: a long prompt with and without early release", ""]
    for b in benches:
        e = b.extra
        mib = 1 << 20
        rows = [["release", e["pool_blocks_release"], f"{e['kv_bytes_release'] / mib:.2f}",
                 e["most_used_release"], duration(b.median)],
                ["keep all", e["pool_blocks_keep"], f"{e['kv_bytes_keep'] / mib:.2f}",
                 e["most_used_keep"], duration(e["keep_median_s"])]]
        lines += [f"{e['model']} (window {e['window']}), {e['prompt_tokens']}-token prompt in "
                  f"{e['chunk_tokens']}-token chunks, blocks of {e['block_size']}:", "",
                  *table(["blocks", "pool (KV blocks)", "KV MiB", "most used", "TTFT"], rows),
                  f"KV memory: {ratio(div(e['kv_bytes_keep'], e['kv_bytes_release']))} less "
                  f"with release; TTFT keep / release: {ratio(e.get('keep_over_release'))}.",
                  ""]
    return lines


SECTIONS = (
    Section("Sliding window", by_suite("window"), _window),
)
