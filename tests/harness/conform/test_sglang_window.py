"""SGLang's sliding-window cache behind the protocol: a full-and-window
`UnifiedRadixCache` over SGLang's own `SWAKVPool` and `SWATokenToKVPoolAllocator`, driven
by its scheduler code (`sglang_unified`, 0.5.23). The contract's window fields are
checked without an engine; one sliding-window op list runs on the cached 0.5.23 install
(skipped where it is not cached, as the engine smoke is)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.conform import ops
from harness.conform.adapters import sglang_options, sglang_tree
from harness.conform.adapters.sglang_unified import contract as unified_contract
from harness.conform.adapters.sglang_window import window_rules
from harness.conform.controller.checks import check_named
from harness.conform.controller.judge import Judge
from harness.conform.controller.locks import find_lock, pinned
from harness.conform.controller.remote import WorkerError
from harness.conform.controller.targets import Target
from harness.conform.protocol import CacheOptions
from tests.harness.conform.cached_engines import open_cached
from tests.harness.conform.window_ops import decode_run_ops, short_window_pool_ops

B = 4
LOCK = next(lock for lock in pinned() if lock.engine == "sglang_unified")


def names(swa: bool) -> SimpleNamespace:
    """What `sglang_options.contract` reads of the scheduler's names: whether the
    release has the tree's SWA component (and no MAMBA one here: test_sglang_mamba.py),
    and 0.5.23's LoRA-naming event recorder; no hierarchical cache (test_sglang_hicache.py)."""
    return SimpleNamespace(swa=("pool", "allocator", "SWA") if swa else None, mamba=None,
                           no_mamba="the Mamba path does not import here (ModuleNotFoundError:"
                                    " No module named 'einops')", mamba_radix=None,
                           no_mamba_radix="no MambaRadixCache in this release",
                           names_requests=True, hicache=False, checkpoints=True)


def test_a_window_is_honoured_only_by_a_unified_tree_with_its_swa_component() -> None:
    base = unified_contract("0.5.23", B)
    assert sglang_options.contract(base, names(True), "unified").options == \
        ("window", "chunk_budget", "window_pool")
    assert sglang_options.contract(base, names(False), "unified").options == \
        ("chunk_budget",)
    assert sglang_options.contract(base, names(True), "radix").options == ("chunk_budget",)
    # a release whose Mamba path does not import (0.5.22's lock has no einops) still runs
    # its full-attention scheduler path, and the hybrid family's skip says why
    terms = sglang_options.contract(base, names(True), "unified")
    assert "the Mamba path does not import here (ModuleNotFoundError: No module named " \
           "'einops')" in str(check_named("hybrid_state").skip_reason(terms))


def test_a_radix_cache_under_the_newest_scheduler_code_says_why_it_opens_no_window() -> None:
    """From 0.5.22 the `sglang` engine's RadixCache opens no window (the server's window
    is the unified tree's SWA component): the sliding-window families' skip says so."""
    terms = sglang_options.contract(unified_contract("0.5.23", B), names(True), "radix")
    assert "window" not in terms.options
    for family in ("sliding_window", "window_off_page", "window_pool_short"):
        assert sglang_options.RADIX_NO_WINDOW in str(check_named(family).skip_reason(terms))


def test_a_windowed_contract_states_sglangs_window_rule_with_its_own_code() -> None:
    base = unified_contract("0.5.23", B)
    plain = sglang_options.contract(base, names(True), "unified")
    windowed = sglang_options.contract(base, names(True), "unified", 8)
    assert (plain.window, plain.window_layout) == (None, "window-only")
    assert (windowed.window, windowed.window_layout) == (8, "window-pool")
    cited = dict(windowed.citations)["window"]
    for where in ("schedule_batch.py:4087", "common.py:100-118", "swa.py:369-375",
                  "swa.py:694-724"):
        assert where in cited
    assert "window" not in dict(plain.citations)


def test_the_judge_counts_no_window_group_in_a_pool_of_its_own() -> None:
    """vLLM's window rule (WindowGroup) is for a window group sharing the full group's
    pool; under "window-pool" the usedNumBlocks are the full group's alone."""
    base = sglang_options.contract(unified_contract("0.5.23", B), names(True),
                                     "unified", 8)
    assert Judge(base, 16).window_group is None
    shared = replace(base, window_layout="full-and-window")
    assert Judge(shared, 16).window_group is not None


# the newest, and the releases whose FULL+SWA tree runs under their older scheduler code
# (sglang_legacy_unified; 0.5.19's SWA allocator takes no request pool, 0.5.19-0.5.20
# keep a request's SWA cursor as a field)
WINDOWED = [pytest.param(LOCK, id="unified-0.5.23"),
            *(pytest.param(find_lock("sglang_unified", v), id=f"legacy-unified-{v}")
              for v in ("0.5.19", "0.5.20", "0.5.21"))]


@pytest.fixture(params=WINDOWED)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    with open_cached(request.param, tmp_path) as opened:
        yield opened


def test_a_window_cache_keeps_what_the_tree_holds_and_reuses_it(target: Target) -> None:
    """A window of 8: A's 24 tokens in chunks of 8, then 5 decoded tokens. SGLang frees
    none of A's window KV meanwhile (what A checkpointed is the tree's, locked for the
    window and evictable below it; its own decode slots are freed only 128 tokens past
    the window, SGLANG_SWA_EVICTION_INTERVAL); B extending A reuses all 28, D sharing
    its first 16 reuses 16; every oracle and the window pool's accounting hold."""
    contract = target.open(16, B, CacheOptions(window=8))
    assert (contract.window, contract.window_layout) == (8, "window-pool")
    judge = Judge(contract, 16)
    op_list = decode_run_ops(5)
    reports = target.apply_all(op_list)
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    assert all(r.integrity == () for r in reports)
    decoded = reports[len(op_list) - 6]  # the last commit of A's decode
    engine = decoded.stats.engine
    assert engine["swa_available_size"] == engine["available_size"]
    assert engine["swa_protected_size"] == 8  # the window's lock, one node of 8
    assert reports[-4].value["reused_tokens"] == 28
    assert reports[-2].value["reused_tokens"] == 16


def test_a_short_window_pool_tombstones_below_the_window_and_shortens_a_match(
        target: Target) -> None:
    """A window of 8 over a window pool of 8 pages (the full pool 32): A's 32 tokens in
    chunks of 8 fill it; its last chunk's allocation finds the pool short and evicts the
    window KV of A's least recently used node below the window, its first 8 tokens
    (tombstoned: their full KV stays). B sharing A's first 12 tokens then reuses 0 (the
    4 tokens past the tombstone fill no window); the judge allows B's shortfall (the
    count oracle says 12), and the window pool's accounting holds."""
    contract = target.open(32, B, CacheOptions(window=8, window_pool=8))
    assert contract.window_pool == 8
    judge = Judge(contract, 32)
    reports = target.apply_all(short_window_pool_ops())
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    assert all(r.integrity == () for r in reports)
    assert [r.stats.harness["windowGapTokens"] for r in reports[5:8]] == [0, 8, 8]
    assert reports[11].value["reused_tokens"] == 0
    # the worker's ValueError, named in its reply
    with pytest.raises(WorkerError, match=r"window_pool 3 .* cannot hold one request"):
        target.open(32, B, CacheOptions(window=8, window_pool=3))


def test_a_refused_first_admission_publishes_nothing(target: Target) -> None:
    """The tree's `reset` in its `__init__` publishes AllBlocksCleared; the adapter takes
    it when it opens the tree, so a first admission refused (2 pages, SGLang keeps 2
    free) publishes nothing and the refusal oracle finds no change (it found one when
    the event reached the first op)."""
    contract = target.open(2, B, CacheOptions(window=2))
    report = target.apply(ops.admit("A", [1]))
    assert (report.status, report.events) == ("refused", ())
    assert Judge(contract, 2).observe(report) == []


def test_page_ownership_problems_name_each_way_a_page_goes_wrong() -> None:
    """`page_problems`, the integrity check all three SGLang adapters share: pages 1..4
    (page 0 is SGLang's padding) each free, in the tree or held once."""
    problems = sglang_tree.page_problems
    assert problems([3], [1, 4], {2}, 4, "requests") == []
    assert problems([3, 3], [1, 4], {2}, 4, "requests") == ["pages held by two requests: [3, 3]"]
    assert problems([3], [1, 4, 4], {2}, 4, "requests") == ["pages free twice: [4]"]
    assert problems([3], [1, 3, 4], {2}, 4, "requests") == ["pages both held and free: [3]"]
    assert problems([2, 3], [1, 4], {2}, 4, "sequences") == \
        ["pages both held and in the tree: [2]"]
    assert problems([3], [1], {2}, 4, "requests") == ["pages owned by nobody (leaked): [4]"]
    assert problems([3], [0, 1, 4], {2}, 4, "requests") == []  # page 0 is no page of the pool


def test_a_radix_trees_pages_are_those_its_nodes_hold_past_the_root() -> None:
    """`radix_tree_pages` walks the nodes (RadixCache's all_values_flatten fails on an
    empty tree): slot // page size for every value but the root's."""
    import torch

    def node(value: list[int] | None, *children: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(value=None if value is None else torch.tensor(value),
                               children={i: c for i, c in enumerate(children)})

    root = node([0, 1, 2, 3], node([4, 5, 6, 7], node([12, 13])), node([8, 9]))
    assert sglang_tree.radix_tree_pages(SimpleNamespace(root_node=root), 4) == {1, 2, 3}
    assert sglang_tree.radix_tree_pages(SimpleNamespace(root_node=node(None)), 4) == set()


@pytest.mark.parametrize(("version", "where", "bound"), [
    ("0.5.19", "swa_component.py:577-619", "floored to a page (mem_cache/common.py:54-119"),
    ("0.5.21", "swa.py:651-693", "cache_unfinished_req"),
    ("0.5.22", "checkpoint_into_tree", "pre_len - max(window, page), floored"),
    ("0.5.23", "swa.py:694-724", "ceil_align(max(window, page), page)")])
def test_each_release_cites_its_own_window_rule(version: str, where: str, bound: str) -> None:
    """The window rule of each release read is cited at its own lines: 0.5.19 keeps its
    SWA component in swa_component.py, 0.5.19-0.5.21 free out-of-window KV when the tree's
    cache_unfinished_req inserts (0.5.22 on: checkpoint_into_tree), and only 0.5.23 keeps
    whole pages of window (ceil_align); an unread release gets the newest's."""
    window, pool = window_rules(version)
    assert where in window and bound in window
    assert window.count("{") == 0 and pool.count("{") == 0
    assert window_rules("0.5.99") == window_rules("0.5.23")
    terms = sglang_options.contract(unified_contract(version, B), names(True), "unified", 8,
                                    window_pool=8)
    assert dict(terms.citations)["window"] == window
    assert dict(terms.citations)["window_pool"] == pool
