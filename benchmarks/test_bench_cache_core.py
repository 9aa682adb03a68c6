"""Cache-core throughput on the two design workloads, and per-request cost vs tree size.

Each workload runs three phases: insert (admit, take the copies, commit, free every
request in order, on a fresh manager), match (the same on a manager that has seen every
request once) and match_reuse (a bare lookup of every request, block ids included, on such
a warm manager). Throughput is tokens per second of the phase (best round), recorded
absolutely and as a ratio to the plain per-block dict trie of
`benchmarks/baseline_trie.py` doing the same, measured in the same run. Prompts are Python
lists, which the manager converts and checks; each phase is also timed fed the same
prompts as `array('I')` (as the engine's requests hold them, taken with one copy): the gap
between the two is what conversion costs.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import pytest

from benchmarks.baseline_trie import PlainTrie
from benchmarks.conftest import best_seconds
from benchmarks.report_format import Section, by_base, div, duration, rate, ratio, table
from harness.reports.bench_results import Benchmark
from harness.workloads import CACHE_BENCH_WORKLOADS
from kvcache import KvCacheConfig, KvCacheManager

B = 16
WORKLOADS = CACHE_BENCH_WORKLOADS
# docs/design.md#benchmark-workloads-and-targets: tokens/s on one core of a 2-core x86-64 VM
TARGETS = {("shared_prompt", "insert"): 100e6, ("shared_prompt", "match"): 110e6,
           ("multi_turn", "insert"): 70e6, ("multi_turn", "match"): 65e6}


PHASES = ("insert", "match", "match_reuse")


Prompts = Sequence[Sequence[int]]  # lists, or array('I') for the manager


class _Cache(Protocol):
    def add_sequence(self, seq_id: int, tokens: Any) -> Any: ...
    def take_copy_ops(self) -> list[Any]: ...
    def commit(self, seq_id: int, num_tokens: int) -> None: ...
    def free_sequence(self, seq_id: int) -> None: ...


def run_phase(cache: _Cache, prompts: Prompts) -> None:
    """Admit, take the copies (as an engine does before its forward pass), commit and
    free each request in order."""
    add, take, commit, free = (cache.add_sequence, cache.take_copy_ops, cache.commit,
                               cache.free_sequence)
    for i, p in enumerate(prompts):
        add(i, p)
        take()
        commit(i, len(p))
        free(i)


def run_lookups(lookup: Callable[[Any], Any], prompts: Prompts) -> None:
    """Look every request up without admitting it."""
    for p in prompts:
        lookup(p)


def lookup_ids(mgr: KvCacheManager) -> Callable[[Sequence[int]], Any]:
    """The manager's bare lookup with its block ids in hand (as a router would use them)."""
    match = mgr.match_reuse
    return lambda p: match(p).block_ids


def timed_phase(phase: str, cache: Any, prompts: Prompts) -> None:
    """Run `phase` on a cache prepared for it (warm for match and match_reuse)."""
    if phase == "match_reuse":
        run_lookups(lookup_ids(cache) if isinstance(cache, KvCacheManager) else cache.match,
                    prompts)
    else:
        run_phase(cache, prompts)


def pool_blocks(prompts: list[list[int]]) -> int:
    return sum(-(-len(p) // B) for p in prompts) + 64


@pytest.fixture(scope="module", params=sorted(WORKLOADS))
def workload(request: pytest.FixtureRequest) -> tuple[str, list[list[int]]]:
    name = request.param
    return name, WORKLOADS[name]()


@pytest.mark.parametrize("phase", PHASES)
def test_cache_core_throughput(benchmark: Any, workload: tuple[str, list[list[int]]],
                               phase: str) -> None:
    name, prompts = workload
    tokens = sum(map(len, prompts))
    blocks = pool_blocks(prompts)
    cfg = KvCacheConfig(tokens_per_block=B, max_num_blocks=blocks, enable_block_reuse=True)

    def fresh() -> tuple[tuple[str, KvCacheManager, list[list[int]]], dict[str, Any]]:
        mgr = KvCacheManager(cfg)
        if phase != "insert":
            run_phase(mgr, prompts)
        return (phase, mgr, prompts), {}

    benchmark.pedantic(timed_phase, setup=fresh, rounds=5, iterations=1)
    trie: list[PlainTrie] = []

    def fresh_trie() -> None:
        trie[:] = [PlainTrie(B, blocks)]
        if phase != "insert":
            run_phase(trie[0], prompts)

    base = tokens / best_seconds(lambda: timed_phase(phase, trie[0], prompts), fresh_trie,
                                 repeat=5)
    arrays = [array("I", p) for p in prompts]
    fed: list[KvCacheManager] = []

    def fresh_fed() -> None:
        fed[:] = [KvCacheManager(cfg)]
        if phase != "insert":
            run_phase(fed[0], arrays)

    fed_arrays = tokens / best_seconds(lambda: timed_phase(phase, fed[0], arrays), fresh_fed,
                                       repeat=5)
    info: dict[str, Any] = {"workload": name, "phase": phase, "tokens": tokens,
                            "baseline_tokens_per_s": base,
                            "arrays_tokens_per_s": fed_arrays}
    if (name, phase) in TARGETS:
        info["target_tokens_per_s"] = TARGETS[(name, phase)]
    if benchmark.stats is not None:
        ours = tokens / benchmark.stats.stats.min
        info.update(tokens_per_s=ours, ratio_to_baseline=ours / base)
    benchmark.extra_info.update(info)


def _random_prompt(rng: np.random.Generator, n: int = 2048) -> list[int]:
    return rng.integers(1, 50_000, size=n).tolist()


@pytest.mark.parametrize("cached_blocks", [1_000, 10_000, 100_000, 1_000_000],
                         ids=["1e3", "1e4", "1e5", "1e6"])
def test_request_cost_is_flat_in_tree_size(benchmark: Any, cached_blocks: int) -> None:
    """One 2,048-token request (half of it a cached prefix) against a tree of N blocks."""
    rng = np.random.default_rng(cached_blocks)
    per_prompt = 2048 // B
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=B, max_num_blocks=cached_blocks + 512,
                                       enable_block_reuse=True))
    for i in range(cached_blocks // per_prompt):
        p = _random_prompt(rng)
        mgr.add_sequence(i, p)
        mgr.take_copy_ops()  # an engine applies them before the forward pass it commits
        mgr.commit(i, len(p))
        mgr.free_sequence(i)
    prefix = p[:1024]
    requests = [prefix + _random_prompt(rng, 1024) for _ in range(64)]
    counter = iter(range(10**9))

    def one_request() -> None:
        i = next(counter)
        tokens = requests[i % len(requests)]
        mgr.add_sequence("r", tokens)
        mgr.take_copy_ops()
        mgr.commit("r", len(tokens))
        mgr.free_sequence("r")

    benchmark(one_request)
    benchmark.extra_info.update(cached_blocks=cached_blocks,
                                tree_nodes=mgr.state.tree.num_nodes)
    mgr.check_integrity()


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --


def _cache_core(benches: Sequence[Benchmark]) -> list[str]:
    rows = []
    for b in sorted(benches, key=lambda b: (b.extra.get("workload", ""), b.name)):
        e = b.extra
        ours = e.get("tokens_per_s") or div(e.get("tokens"), b.min)
        base, target = e.get("baseline_tokens_per_s"), e.get("target_tokens_per_s")
        rows.append([e.get("workload", b.name), e.get("phase", "?"), rate(ours, "tok/s"),
                     rate(base, "tok/s"), ratio(div(ours, base)), rate(target, "tok/s"),
                     ratio(div(ours, target)), rate(e.get("arrays_tokens_per_s"), "tok/s")])
    return ["## Cache core: design workloads (best round)", "",
            "Fed Python lists, as the trie is; the last column feeds ours the same prompts "
            "as `array('I')` (no conversion).", "",
            *table(["workload", "phase", "ours", "baseline trie", "ours / baseline", "target",
                    "ours / target", "ours, fed array('I')"], rows)]


def _tree_size(benches: Sequence[Benchmark]) -> list[str]:
    ordered = sorted(benches, key=lambda b: b.extra.get("cached_blocks", 0))
    first = ordered[0].median
    rows = [[b.extra.get("cached_blocks", "?"), b.extra.get("tree_nodes", "?"),
             duration(b.median), ratio(b.median / first)] for b in ordered]
    return ["## Per-request cost against cached blocks (flat = O(prompt), not O(pool))", "",
            *table(["cached blocks", "tree nodes", "median per request", "vs smallest"], rows),
            f"Largest tree / smallest: {ratio(ordered[-1].median / first)}.", ""]


SECTIONS = (
    Section("Cache core", by_base("test_cache_core_throughput"), _cache_core),
    Section("Per-request cost against cached blocks", by_base("test_request_cost_is_flat_in_tree_size"), _tree_size),
)
