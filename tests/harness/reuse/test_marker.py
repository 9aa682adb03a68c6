"""`@pytest.mark.expect_reuse` end to end, through the kvharness plugin (pytester)."""

from __future__ import annotations

import json

import pytest

from harness.reuse.assertions import diff_stats
from harness.reuse.marker import ReuseWatch
from kvcache import KvCacheConfig, KvCacheManager

pytest_plugins = ["pytester"]

TESTS = '''
import pytest

from harness.reuse.assertions import diff_stats
from harness.reuse.marker import ReuseWatch
from kvcache import KvCacheConfig, KvCacheManager

pytest_plugins = ["pytester"]
from harness.reuse.assertions import Bounds
from kvcache import KvCacheConfig, KvCacheManager


def work(mgr):
    # B=4: [1..9] cold (3 missed), then again: 2 full blocks reused, 1 missed
    for sid in (0, 1):
        mgr.add_sequence(sid, list(range(1, 10)))
        mgr.commit(sid, 9)
        mgr.free_sequence(sid)


@pytest.fixture
def mgr():
    return KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=32))


@pytest.mark.expect_reuse(reusedBlocks=2, missedBlocks=4)
def test_exact(mgr, reuse_watch):
    reuse_watch.watch(mgr)
    work(mgr)


@pytest.mark.expect_reuse(reusedBlocks=Bounds(at_least=1), missed_blocks=Bounds(at_most=4))
def test_bounds(mgr, reuse_watch):
    reuse_watch.watch(mgr)
    work(mgr)


@pytest.mark.expect_reuse(reusedBlocks=3)
def test_wrong(mgr, reuse_watch):
    reuse_watch.watch(mgr)
    work(mgr)


@pytest.mark.expect_reuse(reusedBlocks=0)
def test_unarmed(mgr, reuse_watch):
    work(mgr)


@pytest.mark.expect_reuse(reusedBlocks="2")
def test_bad_value(mgr, reuse_watch):
    reuse_watch.watch(mgr)


@pytest.mark.expect_reuse(reusedBlocks=0)
def test_body_fails_first(mgr, reuse_watch):
    reuse_watch.watch(mgr)
    raise RuntimeError("boom")
'''


@pytest.fixture
def outcome(quiet_pytester: pytest.Pytester) -> pytest.RunResult:
    quiet_pytester.makepyfile(test_marked=TESTS)
    return quiet_pytester.runpytest("--strict-markers", "--kvh-results-dir", "out")


def test_marker_outcomes(outcome: pytest.RunResult) -> None:
    outcome.assert_outcomes(passed=2, failed=4)
    text = outcome.stdout.str()
    assert "reuse mismatch: 1 of 1 checks failed" in text
    assert "total  reusedBlocks  == 3      2       <-- mismatch" in text
    assert "reproduce: pytest test_marked.py::test_wrong" in text
    assert "cache tree:" in text
    assert "test_unarmed: @pytest.mark.expect_reuse needs the reuse_watch fixture" in text
    assert "RuntimeError: boom" in text
    assert ("expect_reuse(reusedBlocks='2'): a counter's expectation is a number or "
            "harness.reuse.assertions.Bounds") in text


def test_marker_records_into_reuse_report(outcome: pytest.RunResult,
                                          quiet_pytester: pytest.Pytester) -> None:
    data = json.loads((quiet_pytester.path / "out" / "reuse_report.json").read_text())
    records = {r["test_id"].split("::")[-1]: r for r in data["records"]}
    assert sorted(records) == ["test_bounds", "test_exact", "test_wrong"]  # malformed: none
    assert records["test_exact"]["expected"] == {"reusedBlocks": 2, "missedBlocks": 4}
    assert records["test_exact"]["stats"]["reusedBlocks"] == 2
    assert (records["test_wrong"]["passed"], records["test_bounds"]["expected"]) == (False, None)
    assert "**FAIL**" in (quiet_pytester.path / "out" / "reuse_report.md").read_text()


def test_watch_sources() -> None:
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8))
    watch = ReuseWatch()
    with pytest.raises(ValueError, match="never armed"):
        watch.snapshots()
    watch.watch(mgr)
    mgr.add_sequence(0, [1, 2, 3])
    before, after = watch.snapshots()
    assert diff_stats(before, after)["missedBlocks"] == 1
    assert watch.tree_dump() == mgr.state.tree.dump()
    counter = iter([{"reusedBlocks": 1}, {"reusedBlocks": 4}])
    watch.watch(lambda: next(counter))  # any zero-argument callable returning stats
    assert diff_stats(*watch.snapshots())["reusedBlocks"] == 3 and watch.tree_dump() is None
    with pytest.raises(ValueError, match="int has neither stats"):
        watch.watch(3)
