"""The host tier: what it buys against device-pool size, and what an onboard costs.

- Hit rate against device-pool size, without a host tier and with one of 4x the pool, on
  the hit-rate suite's workloads and replay (benchmarks/test_bench_hit_rate.py). Timed:
  the replay at the smallest pool with the host tier.
- TTFT against device-pool size, without and with a 4x host tier: multi-turn chats on
  the tiny model, turn-major, each request alone (its first step is its time to first
  token: admission with reuse, onboards, prefill of the rest, sampling). Between two
  turns of a chat the others' turns pass, so a small pool evicts its prefix: recomputed
  without a host tier, onboarded with one. Timed: the host-tier run at the smallest pool.
- An onboard against recomputing the same tokens: a prompt whose first k blocks are
  cached on the device, on the host, or nowhere. Onboard cost = TTFT(host) - TTFT(device),
  recompute cost = TTFT(cold) - TTFT(device), both medians of interleaved rounds; also
  the bare copy of k blocks through KvStorage. Timed: TTFT from the host.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

import pytest
import torch

from benchmarks.conftest import best_seconds, progress
from benchmarks.report_format import Section, by_suite, div, duration, ratio, table
from benchmarks.test_bench_hit_rate import BATCH, WORKLOADS, pool_sizes, replay
from harness.reports.bench_results import Benchmark
from harness.workloads import multi_turn_conversations
from kvcache import Engine, KvCacheConfig
from kvcache.core.ops import BlockOnboard
from kvcache.model import get_preset

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HOST_FACTOR = 4
PRESET, BLOCK, SEED = "tiny", 16, 0


# ------------------------------------------------------------------ hit rate
class TierPoint(NamedTuple):
    """One device-pool size, without and with the host tier."""

    pool_blocks: int
    hit_rate: float
    hit_rate_host: float
    onboarded: int
    offloaded: int
    dropped: int


def tier_point(requests: list[Any], pool_blocks: int) -> TierPoint:
    plain = replay(requests, pool_blocks)
    hosted = replay(requests, pool_blocks, HOST_FACTOR * pool_blocks)
    for mgr in (plain, hosted):
        mgr.check_integrity()
        assert mgr.leak_report() == [], mgr.leak_report()
    a, b = plain.stats(), hosted.stats()
    assert b.reused_blocks >= a.reused_blocks, "a host tier never costs reuse"
    return TierPoint(pool_blocks, a.cache_hit_rate, b.cache_hit_rate, b.onboarded_blocks,
                     b.offloaded_blocks, b.dropped_blocks)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_hit_rate_with_a_host_tier(benchmark: Any, bench_quick: bool, workload: str) -> None:
    requests = WORKLOADS[workload](2 if bench_quick else 8)
    sizes = pool_sizes(requests, 4 if bench_quick else 7)
    curve = [tier_point(requests, n) for n in progress(sizes, f"host tier: {workload}")]
    assert curve[0].onboarded > 0, "the smallest pool must send blocks through the host"
    benchmark.pedantic(replay, args=(requests, sizes[0], HOST_FACTOR * sizes[0]), rounds=3)
    benchmark.extra_info.update(
        suite="host_tier_hit_rate", workload=workload, requests=len(requests), batch=BATCH,
        host_factor=HOST_FACTOR, pool_blocks=[p.pool_blocks for p in curve],
        pool_fraction=[round(p.pool_blocks / sizes[-1], 4) for p in curve],
        block_hit_rate=[round(p.hit_rate, 4) for p in curve],
        block_hit_rate_host=[round(p.hit_rate_host, 4) for p in curve],
        onboarded_blocks=[p.onboarded for p in curve],
        offloaded_blocks=[p.offloaded for p in curve],
        dropped_blocks=[p.dropped for p in curve])


# ------------------------------------------------------------------ TTFT
class Chats(NamedTuple):
    """Multi-turn chats of the tiny model: the turn-major order of (chat, turn)."""

    num_chats: int
    turns: int
    system: int
    user: int
    answer: int


CHATS = Chats(6, 4, 96, 32, 16)
QUICK_CHATS = Chats(4, 3, 64, 32, 8)


def chat_ttfts(chats: Chats, pool_blocks: int, host_blocks: int) -> tuple[list[float], Engine]:
    """Each turn's TTFT (seconds), turn-major; the engine, all requests finished."""
    vocab = get_preset(PRESET).vocab_size
    convs = multi_turn_conversations(chats.num_chats, chats.turns, chats.system, chats.user,
                                     chats.answer, 2, vocab, SEED)
    cfg = KvCacheConfig(tokens_per_block=BLOCK, max_num_blocks=pool_blocks,
                        enable_partial_reuse=False, host_cache_blocks=host_blocks)
    longest = chats.system + chats.turns * (chats.user + chats.answer)
    engine = Engine(PRESET, cfg, max_num_tokens=longest, max_batch_size=1, seed=SEED,
                    record_events=False)
    history = [c.prompt(0) for c in convs]  # then each turn's answer and next user turn
    ttfts: list[float] = []
    for turn in range(chats.turns):
        for i in range(chats.num_chats):
            if turn:
                history[i] += convs[i].users[turn]
            start = time.perf_counter()
            rid = engine.add_request(history[i], chats.answer, return_logits=False)
            outs = engine.step()
            ttfts.append(time.perf_counter() - start)
            while engine.has_unfinished():
                outs += engine.step()
            (out,) = [o for o in outs if o.request_id == rid]
            history[i] += out.token_ids
    return ttfts, engine


@pytest.mark.parametrize("fraction", [pytest.param(f, id=f"pool{f}") for f in (0.25, 0.5, 1.0)])
def test_ttft_with_a_host_tier(benchmark: Any, bench_quick: bool, fraction: float) -> None:
    """Mean TTFT of the chats with a device pool of `fraction` of their footprint (at
    least one request's blocks), without and with a 4x host tier."""
    chats = QUICK_CHATS if bench_quick else CHATS
    longest = chats.system + chats.turns * (chats.user + chats.answer)
    footprint = chats.num_chats * -(-longest // BLOCK)
    pool = max(round(fraction * footprint), -(-longest // BLOCK) + 1)
    plain, plain_engine = chat_ttfts(chats, pool, 0)
    hosted: list[list[float]] = []
    engines: list[Engine] = []

    def run() -> None:
        ttfts, engine = chat_ttfts(chats, pool, HOST_FACTOR * pool)
        hosted.append(ttfts)
        engines.append(engine)

    benchmark.pedantic(run, rounds=1 if bench_quick else 2)
    s, h = plain_engine.kv_cache_stats(), engines[-1].kv_cache_stats()
    for engine in (plain_engine, *engines):
        assert engine.manager.leak_report() == []
    assert h.reused_tokens >= s.reused_tokens
    mean_host = statistics.mean(statistics.median(t) for t in zip(*hosted, strict=True))
    benchmark.extra_info.update(
        suite="host_tier_ttft", model=PRESET, block_size=BLOCK, host_factor=HOST_FACTOR,
        chats=chats.num_chats, turns=chats.turns, footprint_blocks=footprint,
        pool_blocks=pool, pool_fraction=round(pool / footprint, 4),
        mean_ttft_s=statistics.mean(plain), mean_ttft_host_s=mean_host,
        hit_rate=round(s.cache_hit_rate, 4), hit_rate_host=round(h.cache_hit_rate, 4),
        onboarded_blocks=h.onboarded_blocks, offloaded_blocks=h.offloaded_blocks,
        dropped_blocks=h.dropped_blocks, torch_num_threads=torch.get_num_threads())


# ------------------------------------------------------------------ onboard vs recompute
def onboard_setup(k: int) -> tuple[Engine, list[int]]:
    """An engine whose pool holds k + 3 blocks, and a k-block prefix."""
    vocab = get_preset(PRESET).vocab_size
    rng = random.Random(SEED + k)
    prefix = rng.choices(range(1, vocab), k=k * BLOCK)
    cfg = KvCacheConfig(tokens_per_block=BLOCK, max_num_blocks=k + 3,
                        enable_partial_reuse=False, host_cache_blocks=4 * (k + 3))
    engine = Engine(PRESET, cfg, max_num_tokens=(k + 3) * BLOCK, max_batch_size=1, seed=SEED,
                    record_events=False)
    return engine, prefix


@pytest.mark.parametrize("k", [8, 32, 96])
def test_onboard_against_recompute(benchmark: Any, bench_quick: bool, k: int) -> None:
    if bench_quick and k > 32:
        pytest.skip("quick mode: 8 and 32 blocks")
    engine, prefix = onboard_setup(k)
    vocab = get_preset(PRESET).vocab_size
    rng = random.Random(SEED)

    def fresh(n: int) -> list[int]:
        return rng.choices(range(1, vocab), k=n)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        out = engine.generate([prompt], max_new_tokens=1, return_logits=False)[0]
        return time.perf_counter() - start, out.num_cached_tokens

    times: dict[str, list[float]] = {"device": [], "cold": []}

    def others() -> tuple[tuple[list[int]], dict[str, Any]]:
        # cold: a new prefix, recomputed; device: the prefix again, now on the device;
        # then a flush of the whole pool sends the prefix to the host for the timed round
        seconds, cached = ttft(fresh(k * BLOCK + BLOCK + 1))
        times["cold"].append(seconds)
        assert cached == 0
        ttft([*prefix, *fresh(BLOCK + 1)])  # onboards it, if it was on the host
        seconds, cached = ttft([*prefix, *fresh(BLOCK + 1)])
        times["device"].append(seconds)
        assert cached == k * BLOCK
        ttft(fresh((k + 2) * BLOCK + 1))
        return ([*prefix, *fresh(BLOCK + 1)],), {}

    onboarded: list[int] = []

    def from_host(prompt: list[int]) -> None:
        before = engine.kv_cache_stats().onboarded_blocks
        _, cached = ttft(prompt)
        assert cached == k * BLOCK
        onboarded.append(engine.kv_cache_stats().onboarded_blocks - before)

    benchmark.pedantic(from_host, setup=others, rounds=3 if bench_quick else 7,
                       warmup_rounds=1)
    assert set(onboarded) == {k}, f"every timed round onboards the {k} blocks: {onboarded}"
    storage = engine.storage
    ops = [BlockOnboard(i, i, BLOCK) for i in range(k)]
    copy_s = best_seconds(lambda: storage.apply_copies(ops), repeat=5)
    device = statistics.median(times["device"][1:])
    cold = statistics.median(times["cold"][1:])
    benchmark.extra_info.update(
        suite="host_tier_onboard", model=PRESET, block_size=BLOCK, blocks=k,
        tokens=k * BLOCK, device_ttft_s=device, cold_ttft_s=cold, copy_s=copy_s,
        bytes_copied=k * BLOCK * storage.nbytes_per_token,
        torch_num_threads=torch.get_num_threads())
    if benchmark.stats is not None:
        host = benchmark.stats.stats.median
        benchmark.extra_info.update(
            host_ttft_s=host, onboard_s=host - device, recompute_s=cold - device,
            recompute_over_onboard=(cold - device) / max(host - device, 1e-9))


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --


def _host_tier(benches: Sequence[Benchmark]) -> list[str]:
    by: dict[str, list[Benchmark]] = defaultdict(list)
    for b in benches:
        by[str(b.extra["suite"])].append(b)
    factor = benches[0].extra.get("host_factor", "?")
    lines = [f"## Host tier ({factor}x the device pool)", ""]
    for b in sorted(by["host_tier_hit_rate"], key=lambda b: b.extra.get("workload", "")):
        e = b.extra
        rows = zip(e["pool_blocks"], e["pool_fraction"], e["block_hit_rate"],
                   e["block_hit_rate_host"], e["onboarded_blocks"], e["offloaded_blocks"],
                   e["dropped_blocks"], strict=True)
        lines += [f"**Hit rate, {e['workload']}**: {e.get('requests', '?')} requests in steps "
                  f"of {e.get('batch', '?')}; replay at the smallest pool with the host tier "
                  f"{duration(b.median)}.", "",
                  *table(["pool blocks", "of footprint", "block hit rate", "with host tier",
                          "onboarded", "offloaded", "dropped"], [list(r) for r in rows])]
    ttft = sorted(by["host_tier_ttft"], key=lambda b: b.extra["pool_blocks"])
    if ttft:
        e = ttft[0].extra
        lines += [f"**TTFT, multi-turn chats** on the {e.get('model', '?')} model: "
                  f"{e.get('chats', '?')} chats of {e.get('turns', '?')} turns, turn-major, "
                  "one request at a time; mean time to first token.", "",
                  *table(["pool blocks", "of footprint", "TTFT", "with host tier",
                          "with / without", "hit rate", "with host tier", "onboarded"],
                         [[b.extra["pool_blocks"], b.extra["pool_fraction"],
                           duration(b.extra["mean_ttft_s"]),
                           duration(b.extra["mean_ttft_host_s"]),
                           ratio(div(b.extra["mean_ttft_host_s"], b.extra["mean_ttft_s"])),
                           b.extra["hit_rate"], b.extra["hit_rate_host"],
                           b.extra["onboarded_blocks"]] for b in ttft])]
    onboard = sorted(by["host_tier_onboard"], key=lambda b: b.extra["blocks"])
    if onboard:
        lines += ["**An onboard against recomputing the same tokens**: TTFT of a prompt "
                  "whose first k blocks are on the device, on the host or nowhere (medians); "
                  "onboard = host - device, recompute = cold - device; copy = the bare "
                  "host-to-device copy of the k blocks.", "",
                  *table(["blocks", "tokens", "device", "host", "cold", "onboard",
                          "recompute", "recompute / onboard", "copy only"],
                         [[b.extra["blocks"], b.extra["tokens"],
                           duration(b.extra["device_ttft_s"]), duration(b.median),
                           duration(b.extra["cold_ttft_s"]), duration(b.extra.get("onboard_s")),
                           duration(b.extra.get("recompute_s")),
                           ratio(b.extra.get("recompute_over_onboard")),
                           duration(b.extra["copy_s"])] for b in onboard])]
    return lines


SECTIONS = (
    Section("Host tier", by_suite("host_tier"), _host_tier),
)
