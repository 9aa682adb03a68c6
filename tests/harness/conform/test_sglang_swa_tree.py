"""SGLang's `SWARadixCache` (before 0.5.22) behind the protocol: the window rule of
0.5.10's scheduler, which the adapter replicates as the tree's caller, checked without an
engine; one sliding-window op list runs on the cached 0.5.10 install (skipped where it is
not cached, as the engine smoke is)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.conform import ops
from harness.conform.adapters.sglang_swa import decode_frees_window, window_freed
from harness.conform.controller.judge import Judge
from harness.conform.controller.locks import find_lock
from harness.conform.controller.targets import Target
from harness.conform.protocol import CacheOptions
from tests.harness.conform.cached_engines import open_cached

B = 4
LOCK = find_lock("sglang", "0.5.10")


def test_decode_frees_window_kv_at_the_second_step_then_every_window() -> None:
    assert [s for s in range(20) if decode_frees_window(s, 8)] == [1, 9, 17]


@pytest.mark.parametrize(("before", "locked", "pre_len", "want"), [
    pytest.param(0, 24, 25, (24, 24), id="inside-the-window"),
    pytest.param(0, 24, 41, (24, 32), id="below-the-window-past-the-tree"),
    pytest.param(32, 24, 43, (32, 32), id="floored-to-a-page"),
    pytest.param(0, 0, 22, (0, 12), id="nothing-inserted"),
])
def test_window_kv_is_freed_below_the_window_never_below_the_tree(
        before: int, locked: int, pre_len: int, want: tuple[int, int]) -> None:
    assert window_freed(before, locked, pre_len, 8, B) == want


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Target]:
    with open_cached(LOCK, tmp_path) as opened:
        yield opened


def test_a_swa_radix_cache_frees_window_kv_and_still_reuses(target: Target) -> None:
    """A window of 8: A's 24 tokens in chunks of 8 (the tree holds them), then 20 decoded
    tokens; the 18th step frees A's window KV of [24, 32) (two pages), which the free inserts as a
    tombstone. B extending A still reuses all 44 (12 tokens of window KV after the
    tombstone cover the window), D sharing its first 16 reuses 16; every oracle and the
    window pool's accounting hold."""
    contract = target.open(16, B, CacheOptions(window=8))
    assert (contract.window, contract.window_layout) == (8, "window-pool")
    assert not contract.events  # 0.5.10's SWARadixCache publishes none
    judge = Judge(contract, 16)
    a, out = list(range(100, 124)), [900 + i for i in range(20)]
    op_list = [ops.admit("A", a, first_chunk=8), ops.commit("A", 8),
               ops.reserve("A", 16), ops.commit("A", 16),
               ops.reserve("A", 24), ops.commit("A", 24)]
    for i, t in enumerate(out):
        op_list += [ops.append("A", [t]), ops.commit("A", 25 + i)]
    op_list += [ops.free("A"), ops.admit("B", [*a, *out, 1]), ops.free("B"),
                ops.admit("D", [*a[:16], *range(700, 708)]), ops.free("D")]
    reports = target.apply_all(op_list)
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    assert all(r.integrity == () for r in reports)
    before, after = (reports[6 + 2 * step + 1].stats.engine for step in (16, 17))
    assert before["swa_available_size"] == 16 * B - 11 * B  # 11 pages, nothing freed
    assert after["swa_available_size"] == before["swa_available_size"] + 2 * B
    assert reports[-4].value["reused_tokens"] == 44
    assert reports[-2].value["reused_tokens"] == 16


def test_a_short_window_pool_tombstones_below_the_window_and_shortens_a_match(
        target: Target) -> None:
    """A window of 8 over a window pool of 8 pages (the full pool 32): A's 32 tokens in
    chunks of 8 fill it; A's first decode step needs a ninth window page, and the
    caller's eviction (evict_from_tree_cache: the window shortfall) tombstones A's least
    recently used node below the window, its first 8 tokens, though A holds the full KV
    locked (the adapter refused that step while it counted only full KV as evictable).
    B sharing A's first 12 tokens then reuses 0; the judge allows the shortfall."""
    contract = target.open(32, B, CacheOptions(window=8, window_pool=8))
    assert contract.window_pool == 8 and "window_pool" in contract.options
    judge = Judge(contract, 32)
    a = list(range(100, 132))
    op_list = [ops.admit("A", a, first_chunk=8), ops.commit("A", 8)]
    for end in (16, 24, 32):
        op_list += [ops.reserve("A", end), ops.commit("A", end)]
    op_list += [ops.append("A", [900]), ops.commit("A", 33), ops.free("A"),
                ops.admit("B", [*a[:12], *range(700, 712)]), ops.free("B")]
    reports = target.apply_all(op_list)
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    assert all(r.integrity == () for r in reports)
    assert reports[8].status == "done"  # the decode step
    assert [r.stats.harness["windowGapTokens"] for r in reports[7:10]] == [0, 8, 8]
    assert reports[11].value["reused_tokens"] == 0
