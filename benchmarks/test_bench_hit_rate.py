"""Hit rate against pool size on realistic workloads: where reuse pays, and how much pool.

Each workload is replayed through a KvCacheManager the way the engine drives it, one
step at a time: admit a batch of requests (each matched against what is cached now),
commit their prompts (prefill done), append and commit their generated tokens but the
last (whose KV is never computed), free them. Requests of one step do not see each
other's blocks, as in the engine. Pool sizes run geometrically from the least that
fits a full batch to the no-eviction footprint; each point records the block hit rate
(reusedBlocks / (reusedBlocks + missedBlocks)), the token hit rate (reused prompt
tokens / prompt tokens) and the blocks evicted. The pool evicts by priority, then least
recently used; every request here has the default priority, so this is plain LRU.
The timed part is one replay at the smallest pool, where eviction works hardest.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pytest

from benchmarks.conftest import progress
from benchmarks.report_format import Section, by_suite, duration, table
from harness.reports.bench_results import Benchmark
from harness.workloads import few_shot, multi_turn_conversations, shared_system_prompt
from kvcache import KvCacheConfig, KvCacheManager

B, BATCH, VOCAB, SEED, DECODE = 16, 8, 50_000, 0, 32
POLICY = "priority-LRU (uniform priority: LRU)"


class Request(NamedTuple):
    """A prompt and the tokens its generation produces."""

    prompt: list[int]
    generated: list[int]


class CurvePoint(NamedTuple):
    """One pool size's outcome."""

    pool_blocks: int
    block_hit_rate: float
    token_hit_rate: float
    evicted_blocks: int


def _with_decode(prompts: list[list[int]], seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(p, rng.choices(range(1, VOCAB), k=DECODE)) for p in prompts]


def shared_prompt_requests(scale: int) -> list[Request]:
    """32 system prompts of 1,024 tokens, picked with Zipf-like weights 1 / (rank + 1),
    each request + 256 unique tokens: popular prompts stay cached, rare ones compete."""
    systems = shared_system_prompt(32, 1024, 0, 32, VOCAB, SEED)
    rng = random.Random(SEED + 2)
    picks = rng.choices(systems, weights=[1 / (g + 1) for g in range(32)], k=64 * scale)
    return _with_decode([s + rng.choices(range(1, VOCAB), k=256) for s in picks], SEED + 1)


def multi_turn_requests(scale: int) -> list[Request]:
    """Chats of 6 turns, turn-major; the answer of each turn is what it generates."""
    convs = multi_turn_conversations(12 * scale, 6, 256, 64, 128, 4, VOCAB, SEED)
    rng = random.Random(SEED + 1)
    out = []
    for turn in range(6):
        for c in convs:
            answer = list(c.answers[turn]) if turn < 5 else rng.choices(range(1, VOCAB), k=128)
            out.append(Request(c.prompt(turn), answer))
    return out


def few_shot_requests(scale: int) -> list[Request]:
    """4 of 16 examples (128 tokens each) in random order + a 64-token query."""
    return _with_decode(few_shot(64 * scale, 4, 128, 64, VOCAB, SEED, pool_size=16), SEED + 1)


WORKLOADS: dict[str, Callable[[int], list[Request]]] = {
    "shared_prompt": shared_prompt_requests,
    "multi_turn": multi_turn_requests,
    "few_shot": few_shot_requests,
}


def _blocks(req: Request) -> int:
    return -(-(len(req.prompt) + len(req.generated)) // B)


def replay(requests: list[Request], pool_blocks: int, host_blocks: int = 0) -> KvCacheManager:
    """Run `requests` in steps of BATCH through a fresh manager (with a host tier of
    `host_blocks`); returns it, all freed. The ops an engine would apply are taken after
    each phase, as its steps would."""
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=B, max_num_blocks=pool_blocks,
                                       enable_block_reuse=True, host_cache_blocks=host_blocks))
    for start in range(0, len(requests), BATCH):
        step = list(enumerate(requests[start:start + BATCH], start))
        for rid, req in step:
            mgr.add_sequence(rid, req.prompt)
        mgr.take_copy_ops()
        for rid, req in step:
            mgr.commit(rid, len(req.prompt))
        for rid, req in step:
            mgr.append_tokens(rid, req.generated[:-1])
            mgr.commit(rid, len(req.prompt) + len(req.generated) - 1)
            mgr.free_sequence(rid)
        mgr.take_copy_ops()
    return mgr


def point(requests: list[Request], pool_blocks: int) -> CurvePoint:
    """Replay at `pool_blocks` and read its hit rates; checks the manager ends clean."""
    mgr = replay(requests, pool_blocks)
    mgr.check_integrity()
    assert mgr.leak_report() == [], mgr.leak_report()
    s = mgr.stats()
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return CurvePoint(pool_blocks, s.cache_hit_rate, s.reused_tokens / prompt_tokens,
                      s.evicted_blocks)


def pool_sizes(requests: list[Request], num_points: int) -> list[int]:
    """Geometric from one full batch's blocks to the no-eviction footprint + BATCH."""
    low = BATCH * max(map(_blocks, requests))
    unbounded = replay(requests, sum(map(_blocks, requests)))
    high = max(low, unbounded.stats().cached_num_blocks) + BATCH
    ratio = (high / low) ** (1 / (num_points - 1))
    return sorted({round(low * ratio**i) for i in range(num_points - 1)} | {high})


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_hit_rate_curve(benchmark: Any, bench_quick: bool, workload: str) -> None:
    requests = WORKLOADS[workload](2 if bench_quick else 8)
    sizes = pool_sizes(requests, 4 if bench_quick else 9)
    curve = [point(requests, n) for n in progress(sizes, f"hit rate: {workload}")]
    assert curve[-1].evicted_blocks == 0, "the largest pool must hold the whole footprint"
    benchmark.pedantic(replay, args=(requests, sizes[0]), rounds=3)
    benchmark.extra_info.update(
        suite="hit_rate", workload=workload, requests=len(requests), batch=BATCH,
        block_size=B, eviction_policy=POLICY, timed_pool_blocks=sizes[0],
        prompt_tokens=sum(len(r.prompt) for r in requests),
        pool_blocks=[p.pool_blocks for p in curve],
        pool_fraction=[round(p.pool_blocks / sizes[-1], 4) for p in curve],
        block_hit_rate=[round(p.block_hit_rate, 4) for p in curve],
        token_hit_rate=[round(p.token_hit_rate, 4) for p in curve],
        evicted_blocks=[p.evicted_blocks for p in curve],
        max_token_hit_rate=round(curve[-1].token_hit_rate, 4))


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --


def _hit_rate(benches: Sequence[Benchmark]) -> list[str]:
    lines = ["## Hit rate against pool size (engine-like replay, priority-LRU eviction)", ""]
    for b in sorted(benches, key=lambda b: b.extra.get("workload", "")):
        e = b.extra
        rows = zip(e.get("pool_blocks", []), e.get("pool_fraction", []),
                   e.get("block_hit_rate", []), e.get("token_hit_rate", []),
                   e.get("evicted_blocks", []), strict=False)
        lines += [f"**{e.get('workload', b.name)}**: {e.get('requests', '?')} requests in "
                  f"steps of {e.get('batch', '?')}; no-eviction hit rate "
                  f"{e.get('max_token_hit_rate', '?')}; replay at the smallest pool "
                  f"{duration(b.median)}.", "",
                  *table(["pool blocks", "of footprint", "block hit rate", "token hit rate",
                          "evicted blocks"], [list(r) for r in rows])]
    return lines


SECTIONS = (
    Section("Hit rate against pool size", by_suite("hit_rate"), _hit_rate),
)
