"""SGLang 0.5.10 admitting and refusing, judged on the cached install (skipped where it
is not cached, as the engine smoke is), now through its own scheduler code
(`sglang_legacy`): a chunked admission after its allocator over-evicted the prefix it
would have matched (finding 19), which the judge must not take for anything else (the
bounded-match refusal this case first showed under the tree adapter's copy of
`PrefillAdder` is `tests/harness/oracle/test_capacity.py`'s now); and a first admission,
which the tree's construction-time `AllBlocksCleared` must not make look as if it
changed the cache."""

from __future__ import annotations

from pathlib import Path

from harness.conform import ops
from harness.conform.controller.judge import Judge
from harness.conform.controller.locks import find_lock
from harness.conform.protocol import Scope
from tests.harness.conform.cached_engines import open_cached


def test_an_over_evicted_prefix_leaves_a_chunked_admission_unmatched_and_judged_so(
        tmp_path: Path) -> None:
    """Fuzz seed 12 of window_pool_short, on 0.5.10's own code: s1's 16 tokens cached and
    freed; s3 (12 tokens, LoRA y) finds 2 pages free and evicts all 4 of s1's, its whole
    size and a page rather than the shortfall (finding 19); s3's decode step is skipped
    (its prompt is not computed); s7 matches nothing and PrefillAdder cuts its first
    chunk of 5 to a page. Every oracle stays silent: the count oracle, bounded after the
    eviction, allows the empty match."""
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
    assert [r.status for r in reports[-3:]] == ["done", "skipped", "done"]
    assert reports[-3].stats.harness["cachedNumBlocks"] == 0  # all of s1's pages went
    assert (reports[-1].value["reused_tokens"], reports[-1].value["scheduled_tokens"]) \
        == (0, 4)
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
