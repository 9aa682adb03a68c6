"""Cache-aware routing: hit rate and prefill tokens saved by an event-driven router.

N replicas (2, 4, 8), each a KvCacheManager whose pool holds 1.25 / N of the workload's
no-eviction footprint (the cluster holds it all once, with a quarter to spare), serve
the design doc's shared-prompt and multi-turn workloads behind four routers
(benchmarks/router_sim.py): round-robin and random, which ignore the caches, and two
that know each replica's cache only from its KV-cache events, longest-prefix and
longest-prefix within a load bound. Recorded per router: the token hit rate, the prompt
tokens whose prefill was saved, and how uneven the load became (requests on the busiest
replica over the mean). The timed part is one event-driven simulation.

The multi-turn workload has one chat more than a multiple of 8, so that round-robin does
not return every turn of a chat to its replica by accident (it would with 200 chats on
2, 4 or 8 replicas).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from benchmarks.report_format import Section, by_suite, table
from benchmarks.router_sim import BALANCE_SLACK, ROUTERS, SimRequest, footprint_blocks, simulate
from harness.reports.bench_results import Benchmark
from harness.workloads import multi_turn_conversations, shared_system_prompt

B, VOCAB, SEED = 16, 50_000, 0
REPLICAS = (2, 4, 8)
HEADROOM = 1.25


def shared_prompt(scale: int) -> list[SimRequest]:
    """Request i = the 1,536-token system prompt of group i % 10 + 512 unique tokens,
    generating 32 tokens (the design doc's shared-prompt workload, 125 * scale requests)."""
    prompts = shared_system_prompt(125 * scale, 1536, 512, 10, VOCAB, SEED)
    rng = random.Random(SEED + 1)
    return [SimRequest(p, rng.choices(range(1, VOCAB), k=32)) for p in prompts]


def multi_turn(scale: int) -> list[SimRequest]:
    """25 * scale + 1 chats of 8 turns, turn-major; system prompt c % 10 (256 tokens) + 64 user
    tokens, each turn generating the 128-token answer the next turn's prompt carries."""
    convs = multi_turn_conversations(25 * scale + 1, 8, 256, 64, 128, 10, VOCAB, SEED)
    rng = random.Random(SEED + 1)
    return [SimRequest(c.prompt(t), list(c.answers[t]) if t < 7 else
                       rng.choices(range(1, VOCAB), k=128))
            for t in range(8) for c in convs]


WORKLOADS: dict[str, Callable[[int], list[SimRequest]]] = {
    "shared_prompt": shared_prompt, "multi_turn": multi_turn}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_router_hit_rate(benchmark: Any, bench_quick: bool, workload: str) -> None:
    requests = WORKLOADS[workload](1 if bench_quick else 8)
    footprint = footprint_blocks(requests, B)
    rows = []
    for n in REPLICAS[:2] if bench_quick else REPLICAS:
        pool = math.ceil(HEADROOM * footprint / n)
        results = {r: simulate(requests, n, r, B, pool) for r in ROUTERS}
        # the load bound holds (its share so far, +1 for the request being placed)
        share = len(requests) / n
        assert results["balanced_prefix"].imbalance <= (1 + BALANCE_SLACK) * (share + 1) / share
        rows.append((n, pool, results))
    n, pool, _ = rows[-1]
    benchmark.pedantic(simulate, args=(requests, n, "prefix", B, pool), rounds=1)
    benchmark.extra_info.update(
        suite="routing", workload=workload, requests=len(requests), block_size=B,
        footprint_blocks=footprint, headroom=HEADROOM, routers=list(ROUTERS),
        replicas=[n for n, _, _ in rows], pool_blocks=[p for _, p, _ in rows],
        prompt_tokens=rows[0][2]["prefix"].prompt_tokens,
        **{f"{r}_hit_rate": [round(res[r].hit_rate, 4) for _, _, res in rows]
           for r in ROUTERS},
        **{f"{r}_saved_tokens": [res[r].saved_tokens for _, _, res in rows] for r in ROUTERS},
        **{f"{r}_imbalance": [round(res[r].imbalance, 3) for _, _, res in rows]
           for r in ROUTERS})


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --


def _routing(benches: Sequence[Benchmark]) -> list[str]:
    lines = ["## Cache-aware routing (N replicas; hit rate (prefill tokens saved) per "
             "router, load imbalance of the prefix routers)", ""]
    for b in sorted(benches, key=lambda b: b.extra.get("workload", "")):
        e = b.extra
        routers = e.get("routers", [])
        balancing = [r for r in routers if "prefix" in r]  # the cache-blind ones are even
        columns = [e.get("replicas", []), e.get("pool_blocks", []),
                   *([f"{rate:.3f} ({saved / 1e6:.2f} M)" for rate, saved in
                      zip(e.get(f"{r}_hit_rate", []), e.get(f"{r}_saved_tokens", []),
                          strict=False)] for r in routers),
                   *(e.get(f"{r}_imbalance", []) for r in balancing)]
        lines += [f"**{e.get('workload', b.name)}**: {e.get('requests', '?')} requests, "
                  f"{e.get('prompt_tokens', '?')} prompt tokens; each replica's pool holds "
                  f"{e.get('headroom', '?')} / N of the {e.get('footprint_blocks', '?')}-block "
                  "footprint.", "",
                  *table(["replicas", "pool blocks", *routers,
                          *(f"{r} imbalance" for r in balancing)],
                         [list(r) for r in zip(*columns, strict=False)])]
    return lines


SECTIONS = (
    Section("Cache-aware routing", by_suite("routing"), _routing),
)
