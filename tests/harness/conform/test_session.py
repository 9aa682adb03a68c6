"""Session: an op is applied, refused, raised or skipped, and reported with the state."""

from __future__ import annotations

import json
from dataclasses import replace

from harness.conform import ops
from harness.conform.adapters import kvcache
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.adapters.kvcache import contract as kvcache_contract
from harness.conform.controller.families import B
from harness.conform.controller.targets import LocalTarget, replay
from harness.conform.worker.session import Session, StepReport
from tests.harness.conform import faults


def test_ops_invalid_at_their_point_are_skipped_without_calling_the_cache() -> None:
    s = Session(KvcacheCache(8, 4))
    assert s.apply(ops.commit("A", 4)).detail == "'A' is not live"
    done = s.apply(ops.admit("A", list(range(10))))
    assert done.status == "done" and done.value["scheduled_tokens"] == 10
    late = s.apply(ops.commit("A", 11))
    assert (late.status, late.detail) == ("skipped", "commit of 11 tokens: 0 are committed "
                                                     "and 10 scheduled")
    assert s.apply(ops.admit("A", [1])).detail == "'A' is already live"
    assert s.apply(ops.commit("A", 10)).status == "done"
    assert s.apply(ops.commit("A", 4)).status == "skipped"  # backwards


def test_a_refusal_and_the_leak_report_at_quiescence() -> None:
    s = Session(KvcacheCache(4, 4))
    a = s.apply(ops.admit("A", list(range(12))))
    assert a.leaks is None  # something is live: no leak report
    b = s.apply(ops.admit("B", list(range(50, 62))))
    assert b.status == "refused" and b.log == () and b.events == ()
    freed = s.apply(ops.free("A"))
    assert freed.leaks == ()


def test_what_the_engine_raised_is_reported_with_its_place() -> None:
    s = Session(faults.RaisesOnAppend(8, 4))
    s.apply(ops.admit("A", [1, 2, 3]))
    r = s.apply(ops.append("A", [4]))
    assert r.status == "raised"
    assert r.detail.startswith("AttributeError: 'LoRARequest' object has no attribute 'id' "
                               "(raised at ")
    assert "in append)" in r.detail


def test_a_step_report_survives_the_pipe() -> None:
    s = Session(KvcacheCache(8, 4))
    r = s.apply(ops.admit("A", list(range(9))))
    again = StepReport.from_dict(json.loads(json.dumps(r.as_dict())))
    assert again == r


def test_a_report_keeps_what_its_op_logged_then() -> None:
    # an adapter that logs a sequence's own token list, which the append then extends;
    # a batch's reports are read (or sent) after all its ops ran
    target = LocalTarget(kvcache.load(faults.LogsLiveTokens))
    op_list = [ops.admit("s26", range(14)), ops.append("s26", [30, 31])]
    target.open(12, B)
    admitted, appended = target.apply_all(op_list)
    assert len(admitted.log[0]["tokens"]) == 14 and appended.log[0]["tokens"] == [30, 31]
    # read late, the admission held 16 tokens, and the append's 2 more need a 5th block
    assert replay(target, op_list, 12, B) == []


class _Retracts(KvcacheCache):
    """kvcache's manager under a contract that retracts only between decode steps and
    schedules a chunk only after the last one is computed (SGLang's)."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True) -> None:
        super().__init__(num_blocks, block_size, record=record)
        self._contract = replace(kvcache_contract(block_size), preemption="retracts-decode",
                                 chunking="caller-page-floor")


def test_a_preempt_is_skipped_where_the_contract_has_no_such_preemption() -> None:
    none = Session(KvcacheCache(8, 4))
    none.cache._contract = replace(kvcache_contract(4), preemption="none")  # type: ignore[attr-defined]
    none.apply(ops.admit("A", list(range(9))))
    assert none.apply(ops.preempt("A")).detail == "the contract has no preemption path"
    s = Session(_Retracts(8, 4))
    s.apply(ops.admit("A", list(range(9))))
    early = s.apply(ops.preempt("A"))
    assert (early.status, early.detail) == ("skipped", "preempt before all 9 tokens are "
                                            "computed (0): the engine retracts only between "
                                            "decode steps")
    assert s.apply(ops.reserve("A", 9)).detail == (
        "reserve before the 9 scheduled tokens are computed (0): the engine schedules a "
        "chunk after the last one")
    s.apply(ops.commit("A", 9))
    assert s.apply(ops.preempt("A")).status == "done"
    assert s.apply(ops.commit("A", 9)).detail == "'A' is not live"


def test_under_a_page_budget_a_chunk_is_scheduled_only_after_the_last_is_computed() -> None:
    cache = KvcacheCache(8, 4)
    cache._contract = replace(kvcache_contract(4), chunking="page-budget", chunk_budget=4)
    s = Session(cache)
    s.apply(ops.admit("A", list(range(9))))
    assert s.apply(ops.reserve("A", 9)).detail == (
        "reserve before the 9 scheduled tokens are computed (0): the engine schedules a "
        "chunk after the last one")
    s.apply(ops.commit("A", 9))
    assert s.apply(ops.reserve("A", 9)).status == "done"


def test_kvcache_preempts_as_its_scheduler_does_and_the_resumption_reuses_its_blocks() -> None:
    s = Session(KvcacheCache(8, 4))
    s.apply(ops.admit("A", list(range(9))))
    s.apply(ops.commit("A", 9))
    done = s.apply(ops.preempt("A"))
    assert done.status == "done" and done.used_blocks == 0 and done.leaks == ()
    assert [e["kind"] for e in done.log] == ["free"]
    again = s.apply(ops.admit("A", list(range(9))))
    assert again.value["reused_tokens"] == 8
