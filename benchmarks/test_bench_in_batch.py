"""N siblings that arrive together: one prefill of their prefix, or N?

N prompts (a 512-token prefix plus 32 tokens of their own; 256 + 16 in quick mode) go to
the tiny model in one `generate` call with max_new_tokens=1, timed end to end, three
ways in the same run, alternating round by round so they see the same machine load:
- shared: in-batch prefix sharing on (the default): the first sibling computes the
  prefix, the others wait for its commit and reuse it;
- separate: sharing off: every sibling computes the whole prompt in one step;
- ideal: one prefill of the prefix alone, then the N siblings over the cached prefix
  (what the shared run cannot beat).
Recorded: each median, shared / ideal, separate / shared, and the tokens computed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import pytest

from benchmarks.report_format import Section, by_suite, duration, ratio, table
from harness.reports.bench_results import Benchmark
from harness.workloads import shared_system_prompt
from kvcache import Engine, KvCacheConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK, VOCAB, SEED = 16, 512, 0


def _engine(n: int, prompt_len: int, share: bool) -> Engine:
    blocks = 2 * n * (prompt_len // BLOCK + 2)
    cfg = KvCacheConfig(tokens_per_block=BLOCK, max_num_blocks=blocks, enable_block_reuse=True)
    return Engine("tiny", cfg, max_num_tokens=n * prompt_len, max_batch_size=n,
                  share_prefixes=share, record_events=False, seed=SEED)


def _timed(run: Any) -> tuple[float, Engine]:
    start = time.perf_counter()
    engine = run()
    return time.perf_counter() - start, engine


@pytest.mark.parametrize("n", [2, 8, 32])
def test_siblings_share_one_prefill(benchmark: Any, bench_quick: bool, n: int) -> None:
    if bench_quick and n > 8:
        pytest.skip("quick mode: N = 2 and 8 only")
    prefix, own = (256, 16) if bench_quick else (512, 32)
    rounds = 2 if bench_quick else 3
    times: dict[str, list[float]] = {"separate": [], "ideal": []}
    computed: dict[str, int] = {}
    seed = iter(range(1000))

    def prompts() -> list[list[int]]:
        return shared_system_prompt(n, prefix, own, vocab=VOCAB, seed=next(seed))

    def shared_run() -> None:
        engine = _engine(n, prefix + own, share=True)
        outs = engine.generate(prompts(), max_new_tokens=1, return_logits=False)
        assert [o.num_cached_tokens for o in outs] == [0] + [prefix] * (n - 1)
        computed["shared"] = engine.num_computed_tokens

    def others() -> tuple[tuple[()], dict[str, Any]]:
        batch = prompts()
        t, engine = _timed(lambda: _separate(batch))
        times["separate"].append(t)
        computed["separate"] = engine.num_computed_tokens
        t, engine = _timed(lambda: _ideal(batch, prefix))
        times["ideal"].append(t)
        computed["ideal"] = engine.num_computed_tokens
        return (), {}

    def _separate(batch: list[list[int]]) -> Engine:
        engine = _engine(n, prefix + own, share=False)
        engine.generate(batch, max_new_tokens=1, return_logits=False)
        return engine

    def _ideal(batch: list[list[int]], prefix_len: int) -> Engine:
        engine = _engine(n, prefix + own, share=False)
        engine.generate([[*batch[0][:prefix_len], 0]], max_new_tokens=1, return_logits=False)
        outs = engine.generate(batch, max_new_tokens=1, return_logits=False)
        assert all(o.num_cached_tokens == prefix_len for o in outs)
        return engine

    benchmark.pedantic(shared_run, setup=others, rounds=rounds)
    separate = statistics.median(times["separate"])
    ideal = statistics.median(times["ideal"])
    benchmark.extra_info.update(
        suite="in_batch", siblings=n, prefix_tokens=prefix, own_tokens=own, block_size=BLOCK,
        separate_median_s=separate, ideal_median_s=ideal,
        computed_tokens=dict(computed))
    if benchmark.stats is not None:
        shared = benchmark.stats.stats.median
        benchmark.extra_info.update(shared_over_ideal=shared / ideal,
                                    separate_over_shared=separate / shared)
    assert computed["shared"] <= prefix + n * own + BLOCK
    assert computed["separate"] == n * (prefix + own)


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --


def _in_batch(benches: Sequence[Benchmark]) -> list[str]:
    lines = ["## In-batch prefix sharing (N siblings in one generate call, tiny model)", ""]
    rows = []
    for b in sorted(benches, key=lambda b: b.extra.get("siblings", 0)):
        e = b.extra
        done = e.get("computed_tokens", {})
        rows.append([e.get("siblings"), f"{e.get('prefix_tokens')} + {e.get('own_tokens')}",
                     duration(b.median), duration(e.get("separate_median_s")),
                     duration(e.get("ideal_median_s")), ratio(e.get("shared_over_ideal")),
                     ratio(e.get("separate_over_shared")),
                     f"{done.get('shared', '?')} / {done.get('separate', '?')}"])
    return lines + table(["N", "prefix + own tokens", "shared", "separate", "ideal",
                          "shared / ideal", "separate / shared",
                          "tokens computed shared / separate"], rows)


SECTIONS = (
    Section("In-batch prefix sharing", by_suite("in_batch"), _in_batch),
)
