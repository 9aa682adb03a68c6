"""SGLang 0.5.10's `RadixCache` refusing, judged on the cached install (skipped where it
is not cached, as the engine smoke is): a chunked admission after an eviction, whose
first chunk counts from its match's end and whose lock takes the matched page from the
evictable ones (`PrefillAdder.add_one_req`), so a match needs more than none does; and a
first admission, which the tree's construction-time `AllBlocksCleared` must not make
look as if it changed the cache."""

from __future__ import annotations

from pathlib import Path

from harness.conform import ops
from harness.conform.controller.judge import Judge
from harness.conform.controller.locks import find_lock
from harness.conform.protocol import Scope
from tests.harness.conform.cached_engines import open_cached


def test_a_chunked_admission_refused_for_its_matched_page_is_fair(tmp_path: Path) -> None:
    """Fuzz seed 12 of window_pool_short: s1's 16 tokens cached and freed; s3, in LoRA
    y's scope, evicts s1's last two pages and holds 4 of the 6; s7 matches s1's page
    [1-4], which with its first chunk of 5 needs 3 pages against 2 free or evictable.
    SGLang refuses it, fairly; the judge, whose count oracle lost track of the eviction,
    had assumed no match (2 pages) and called the refusal unfair."""
    with open_cached(find_lock("sglang", "0.5.10"), tmp_path) as target:
        contract = target.open(6, 4)
        judge = Judge(contract, 6)
        reports = target.apply_all([
            ops.admit("s1", [*range(1, 12), 11, 10, 12, 13, 9]), ops.commit("s1", 11),
            ops.commit("s1", 16), ops.free("s1"),
            ops.admit("s3", [1, 2, 3, 4, 14, 10, 1, 5, 15, 16, 17, 6],
                      Scope.lora("y", 1)),
            ops.append("s3", [3]),
            ops.admit("s7", [1, 2, 3, 4, 5, 6, 8, 7, 3], first_chunk=5)])
        found = [v for r in reports for v in judge.observe(r)]
    assert reports[-1].status == "refused", reports[-1]
    assert found == [], found


def test_a_refused_first_admission_publishes_nothing(tmp_path: Path) -> None:
    """The tree's reset in its constructor publishes `AllBlocksCleared`; the adapter takes
    it at open, so a refused first op has published nothing (it had been judged as a
    refusal that changed the cache)."""
    with open_cached(find_lock("sglang", "0.5.10"), tmp_path) as target:
        judge = Judge(target.open(2, 4), 2)
        reports = target.apply_all([ops.admit("a", list(range(1, 20))),
                                    ops.admit("b", [1, 2, 3])])
        found = [v for r in reports for v in judge.observe(r)]
    assert [r.status for r in reports] == ["refused", "done"]
    assert reports[0].events == () and found == [], found
