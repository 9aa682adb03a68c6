"""The oracles after a test: the plugin replays the provenance of caches that recorded
their log and checks every cache's block count, next to the leak check."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.oracle.after_test import capacity_of, oracle_problems
from harness.oracle.checked_manager import CheckedManager
from kvcache import KvCacheConfig, KvCacheManager, KvCacheStats

pytest_plugins = ["pytester"]

TESTS = """\
import pytest
from kvcache import KvCacheManager, KvCacheConfig


class DropsCopiesWithTheirSequence(KvCacheManager):
    # the cache before the fix: a freed sequence's queued copies went, its tail stayed
    def free_sequence(self, seq_id):
        self.state.op_queue = [e for e in self.state.op_queue if e[0] != seq_id]
        super().free_sequence(seq_id)


class Engine:
    def __init__(self, cls):
        cfg = KvCacheConfig(tokens_per_block=4, max_num_blocks=4)
        self.cache_manager = cls(cfg, record_events=True)

    def run_issue_example(self):
        # as an engine drives it: copies taken before every forward pass (commit)
        m = self.cache_manager
        m.add_sequence("A", [1, 2, 2, 2, 0]); m.take_copy_ops(); m.commit("A", 5)
        m.free_sequence("A")
        m.add_sequence("B", [1, 2, 2, 0, 1]); m.add_sequence("C", [7] * 5)
        m.free_sequence("B")
        m.add_sequence("D", [1, 2, 2, 9]); m.take_copy_ops(); m.commit("D", 4)
        m.take_copy_ops(); m.commit("C", 5)
        m.free_sequence("C"); m.free_sequence("D")


@pytest.fixture
def engine(): return Engine(KvCacheManager)

@pytest.fixture
def old_engine(): return Engine(DropsCopiesWithTheirSequence)


def test_right(engine): engine.run_issue_example()
def test_unwritten_kv_read(old_engine): old_engine.run_issue_example()
"""


def test_plugin_replays_each_recorded_log(quiet_pytester: pytest.Pytester) -> None:
    quiet_pytester.makepyfile(test_caches=TESTS)
    result = quiet_pytester.runpytest()
    result.assert_outcomes(passed=2, errors=1)
    (error,) = [r.longreprtext
                for r in result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
                if r.when == "teardown" and r.failed]
    assert "test_unwritten_kv_read left its cache unclean (1 problems)" in error
    assert ("old_engine.cache_manager (DropsCopiesWithTheirSequence): provenance violation "
            "at event #8: commit 'D' (a forward pass) reads KV that is not its own") in error


class MiscountsUsedBlocks(KvCacheManager):
    """Reports one block more in use than it has."""

    def stats(self) -> KvCacheStats:
        s = super().stats()
        return replace(s, used_num_blocks=s.used_num_blocks + 1)


def test_a_cache_whose_block_count_is_off_is_reported() -> None:
    cfg = KvCacheConfig(tokens_per_block=2, max_num_blocks=8)
    right, wrong = KvCacheManager(cfg), MiscountsUsedBlocks(cfg)
    for mgr in (right, wrong):
        mgr.add_sequence("x", [1, 2, 3])
        mgr.commit("x", 3)
    assert capacity_of(right).needed == 2
    assert oracle_problems([("right", right)]) == []
    (problem,) = oracle_problems([("wrong", wrong)])
    assert problem.startswith("wrong (MiscountsUsedBlocks): capacity: after the test, "
                              "usedNumBlocks differs")
    assert "expected  2 (1 held in the cache, 1 private)\n  actual    3" in problem


def test_a_checked_manager_is_checked_on_its_own_state() -> None:
    cfg = KvCacheConfig(tokens_per_block=2, max_num_blocks=8)
    mgr = CheckedManager(KvCacheManager(cfg, record_events=True))
    mgr.add_sequence("x", [1, 2, 3])
    assert oracle_problems([("mgr", mgr), ("other", object())]) == []
