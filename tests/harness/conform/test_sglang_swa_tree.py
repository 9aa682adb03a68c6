"""SGLang's `SWARadixCache` (before 0.5.22) behind the protocol: the window rule of
0.5.10's scheduler, which the adapter replicates as the tree's caller, checked without an
engine; the sliding-window op lists run on the cached 0.5.8, 0.5.9 and 0.5.10 installs
(and 0.5.12's, 0.5.18's own; each skipped where it is not cached, as the engine smoke
is)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.conform import ops
from harness.conform.adapters.sglang_swa import decode_frees_window, window_freed, window_rule
from harness.conform.controller.judge import Judge
from harness.conform.controller.locks import find_lock
from harness.conform.controller.targets import Target
from harness.conform.protocol import CacheOptions
from tests.harness.conform.cached_engines import open_cached
from tests.harness.conform.window_ops import decode_run_ops, short_window_pool_ops

B = 4


@pytest.mark.parametrize(("rule", "window", "want"), [
    pytest.param("0.5.10", 8, [1, 9, 17], id="0.5.10-every-window"),
    pytest.param("0.5.10", 6, [1, 7, 13, 19], id="0.5.10-window-6"),
    pytest.param("0.5.12", 8, [1, 9, 17], id="0.5.12-window-in-pages"),
    pytest.param("0.5.12", 6, [1, 5, 9, 13, 17], id="0.5.12-floored-to-a-page"),
])
def test_decode_frees_window_kv_at_the_second_step_then_every_interval(
        rule: str, window: int, want: list[int]) -> None:
    assert [s for s in range(20) if decode_frees_window(rule, s, window, B, 0, 0)] == want


@pytest.mark.parametrize(("step", "pre_len", "swa_evicted", "want"), [
    pytest.param(0, 200, 0, False, id="never-the-first-step"),
    pytest.param(1, 135, 0, False, id="127-slid-out"),
    pytest.param(1, 136, 0, True, id="128-slid-out"),
    pytest.param(5, 167, 32, False, id="127-past-the-last-free"),
    pytest.param(5, 168, 32, True, id="128-past-the-last-free"),
])
def test_0_5_18_frees_window_kv_once_128_tokens_slid_out(step: int, pre_len: int,
                                                        swa_evicted: int, want: bool) -> None:
    assert decode_frees_window("0.5.18", step, 8, B, pre_len, swa_evicted) is want


@pytest.mark.parametrize(("rule", "before", "locked", "pre_len", "window", "want"), [
    pytest.param("0.5.10", 0, 24, 25, 8, (24, 24), id="0.5.10-inside-the-window"),
    pytest.param("0.5.10", 0, 24, 41, 8, (24, 32), id="0.5.10-below-the-window"),
    pytest.param("0.5.10", 32, 24, 43, 8, (32, 32), id="0.5.10-floored-to-a-page"),
    pytest.param("0.5.10", 0, 0, 22, 8, (0, 12), id="0.5.10-nothing-inserted"),
    pytest.param("0.5.12", 0, 24, 41, 8, (24, 28), id="0.5.12-a-page-short"),
    pytest.param("0.5.12", 0, 0, 22, 8, (0, 8), id="0.5.12-nothing-inserted"),
    pytest.param("0.5.18", 0, 24, 41, 8, (24, 32), id="0.5.18-the-window"),
    pytest.param("0.5.18", 0, 0, 22, 2, (0, 16), id="0.5.18-at-least-a-page"),
])
def test_window_kv_is_freed_below_the_window_never_below_the_tree(
        rule: str, before: int, locked: int, pre_len: int, window: int,
        want: tuple[int, int]) -> None:
    assert window_freed(rule, before, locked, pre_len, window, B) == want


@pytest.mark.parametrize(("version", "rule"), [
    pytest.param("0.5.8", "0.5.10", id="0.5.8"), pytest.param("0.5.9", "0.5.10", id="0.5.9"),
    pytest.param("0.5.10", "0.5.10", id="0.5.10"), pytest.param("0.5.11", "0.5.10", id="0.5.11"),
    pytest.param("0.5.12.post1", "0.5.12", id="0.5.12.post1"),
    pytest.param("0.5.18", "0.5.18", id="0.5.18"),
])
def test_each_release_runs_the_newest_window_rule_before_it(version: str, rule: str) -> None:
    assert window_rule(version) == rule


@pytest.fixture(params=["0.5.10", "0.5.9", "0.5.8"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """0.5.10's SWARadixCache, and 0.5.9's and 0.5.8's (the same window rule; their
    tree's calls the older forms: positional insert and evict on 0.5.8, the lock's
    receipt a bare uuid on both)."""
    with open_cached(find_lock("sglang", request.param), tmp_path) as opened:
        yield opened


def _decode_run(target: Target, num_blocks: int, decoded: int) -> tuple[Judge, list, list]:
    """A window of 8: A's 24 tokens in chunks of 8 (the tree holds them), `decoded`
    tokens decoded one a step, A freed; B extending A, then D sharing A's first 16. The
    reports and the judge's findings."""
    contract = target.open(num_blocks, B, CacheOptions(window=8))
    assert (contract.window, contract.window_layout) == (8, "window-pool")
    judge = Judge(contract, num_blocks)
    reports = target.apply_all(decode_run_ops(decoded))
    return judge, reports, [v for r in reports for v in judge.observe(r)]


def _swa_free_after_step(reports: list, step: int) -> int:
    return int(reports[6 + 2 * step + 1].stats.engine["swa_available_size"])


def test_a_swa_radix_cache_frees_window_kv_and_still_reuses(target: Target) -> None:
    """A window of 8: A's 24 tokens in chunks of 8 (the tree holds them), then 20 decoded
    tokens; the 18th step frees A's window KV of [24, 32) (two pages), which the free inserts as a
    tombstone. B extending A still reuses all 44 (12 tokens of window KV after the
    tombstone cover the window), D sharing its first 16 reuses 16; every oracle and the
    window pool's accounting hold."""
    judge, reports, found = _decode_run(target, 16, 20)
    assert not judge.contract.events  # 0.5.10's SWARadixCache publishes none
    assert found == [], found
    assert all(r.integrity == () for r in reports)
    before, after = (reports[6 + 2 * step + 1].stats.engine for step in (16, 17))
    assert before["swa_available_size"] == 16 * B - 11 * B  # 11 pages, nothing freed
    assert after["swa_available_size"] == before["swa_available_size"] + 2 * B
    assert reports[-4].value["reused_tokens"] == 44
    assert reports[-2].value["reused_tokens"] == 16


def test_0_5_12s_swa_radix_cache_frees_a_page_short_of_the_window(tmp_path: Path) -> None:
    """0.5.12 (its real pools under the lock's override): the run above, whose 18th step
    frees only [24, 28) (the window and a page kept); B still reuses all 44, D 16; every
    oracle and the window pool's accounting hold, and the tree publishes KV events."""
    with open_cached(find_lock("sglang", "0.5.12"), tmp_path) as target:
        judge, reports, found = _decode_run(target, 16, 20)
    assert found == [], found
    assert judge.contract.events  # KVCacheEventMixin from 0.5.12
    assert all(r.integrity == () for r in reports)
    before, after = (_swa_free_after_step(reports, step) for step in (16, 17))
    assert before == 16 * B - 11 * B  # 11 pages, nothing freed
    assert after == before + 1 * B
    assert reports[-4].value["reused_tokens"] == 44
    assert reports[-2].value["reused_tokens"] == 16


def test_0_5_18s_swa_radix_cache_frees_window_kv_once_128_tokens_slid_out(
        tmp_path: Path) -> None:
    """0.5.18: 116 decoded tokens; nothing is freed until 128 have slid out of the window
    (step 112, 136 tokens computed), which frees [24, 128) (26 pages) while the step takes
    a page; B extending A reuses all 140 (12 tokens of window KV after the tombstones),
    D 16."""
    with open_cached(find_lock("sglang", "0.5.18"), tmp_path) as target:
        _, reports, found = _decode_run(target, 48, 116)
    assert found == [], found
    assert all(r.integrity == () for r in reports)
    before, after = (_swa_free_after_step(reports, step) for step in (111, 112))
    assert before == 48 * B - 34 * B  # 34 pages, nothing freed
    assert after == before - B + 26 * B
    assert reports[-4].value["reused_tokens"] == 140
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
    reports = target.apply_all(short_window_pool_ops())
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    assert all(r.integrity == () for r in reports)
    assert reports[8].status == "done"  # the decode step
    assert [r.stats.harness["windowGapTokens"] for r in reports[7:10]] == [0, 8, 8]
    assert reports[11].value["reused_tokens"] == 0


def test_an_append_before_the_prompt_is_computed_frees_no_window_kv(target: Target) -> None:
    """SGLang decodes only after a request's extend is done, so `maybe_evict_swa` never
    frees KV not yet computed: an append the protocol makes before the prompt's commit
    frees no window KV (the adapter freed [0, 8) there, which the tree then held as live
    window KV: a false integrity finding, shrunk from a fuzz seed with a window pool)."""
    contract = target.open(3, B, CacheOptions(window=3))
    judge = Judge(contract, 3)
    reports = target.apply_all([ops.admit("s4", list(range(1, 11))),
                                ops.append("s4", [11, 12]), ops.commit("s4", 9),
                                ops.free("s4")])
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    assert all(r.integrity == () for r in reports)
