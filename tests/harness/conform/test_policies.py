"""The contract's documented policies, judged: preemption and resumption (the op, the
session, the counters of resumed admissions), the eviction order the judge follows block
by block (vLLM's free queue, by hand-written step reports), cache options, and the
policy families on kvcache's manager, each with a planted fault it must catch."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import pytest

from harness.conform import ops
from harness.conform.adapters import kvcache, sglang_scheduler
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.adapters.vllm import contract as vllm_contract
from harness.conform.controller import policy_families
from harness.conform.controller.checks import check_named
from harness.conform.controller.eviction import FreeQueue
from harness.conform.controller.families import B, Run
from harness.conform.controller.fuzz import fuzz
from harness.conform.controller.judge import Judge, Violation
from harness.conform.controller.runner import run_check
from harness.conform.controller.targets import LocalTarget
from harness.conform.controller.window_group import WindowGroup
from harness.conform.protocol import (
    CacheOptions,
    Contract,
    Scope,
    Stats,
    open_cache,
)
from harness.conform.worker.session import Session, StepReport
from harness.oracle.types import normalize_event

# vLLM 0.33.0's contract as its manager-level adapter states it: its free queue, its
# preempted_* counters
VLLM = vllm_contract("0.33.0", B, True)


# -- the op and the session ---------------------------------------------------------------


def test_a_preempted_sequence_leaves_and_resumes_with_exactly_its_tokens() -> None:
    s = Session(KvcacheCache(16, B))
    prompt = list(range(100, 110))
    s.apply(ops.admit("A", prompt, Scope(salt="x")))
    s.apply(ops.commit("A", 10))
    s.apply(ops.append("A", [900]))
    r = s.apply(ops.preempt("A"))
    assert (r.status, r.preempted, r.log[-1]["kind"]) == ("done", ("A",), "free")
    assert s.apply(ops.commit("A", 11)).detail == "'A' is not live"
    other = s.apply(ops.admit("A", prompt, Scope(salt="x")))  # its decoded token dropped
    assert other.status == "skipped" and "resumes with exactly those" in other.detail
    unsalted = s.apply(ops.admit("A", [*prompt, 900]))
    assert unsalted.status == "skipped"
    back = s.apply(ops.admit("A", [*prompt, 900], Scope(salt="x")))
    assert back.status == "done" and back.value["reused_tokens"] == 10  # all but the last
    assert s.apply(ops.free("A")).leaks == ()


def test_the_op_and_report_round_trip_as_json() -> None:
    op = ops.Op.from_dict(ops.preempt("A").as_dict())
    assert op == ops.preempt("A") and op.describe() == "preempt(A)"
    with pytest.raises(ValueError, match="a preempt op: unknown keys"):
        ops.Op.from_dict({"kind": "preempt", "seq": "A", "tokens": [1]})
    r = StepReport(ops.preempt("A"), "done", preempted=("A",))
    assert StepReport.from_dict(r.as_dict()) == r


class NoPreemption(KvcacheCache):
    """kvcache's manager under a contract without a preemption path."""

    @property
    def contract(self) -> Contract:
        return replace(super().contract, preemption="none")


def test_a_contract_without_preemption_skips_the_op_and_the_families() -> None:
    s = Session(NoPreemption(8, B))
    s.apply(ops.admit("A", [1, 2, 3]))
    assert s.apply(ops.preempt("A")).detail == "the contract has no preemption path"
    target = LocalTarget(kvcache.load(NoPreemption))
    result = run_check(target, check_named("preemption_resume"))
    assert result.status == "skip" and "no preemption path" in result.message


class ClaimsPreemption(KvcacheCache):
    """A contract naming a preemption path its adapter does not offer."""

    preempt = None  # type: ignore[assignment]


def test_a_contract_naming_a_path_the_adapter_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="has no preempt/take_preempted"):
        Session(ClaimsPreemption(8, B))


# -- counters of resumed admissions ----------------------------------------------------------


def _report(op: ops.Op, log: list[dict[str, Any]], engine: dict[str, int], *,
            value: Any = None, used: int = 0, preempted: tuple[str, ...] = (),
            events: tuple[dict[str, Any], ...] = ()) -> StepReport:
    return StepReport(op, "done", value, "", tuple(log), events, used, None,
                      Stats(engine, {}), (), None if used else (), preempted)


def _admit(seq: str, tokens: list[int], reused: int, ids: list[int]) -> list[dict[str, Any]]:
    return [{"kind": "admit", "seq_id": seq, "tokens": tokens, "num_tokens": reused,
             "scope": None, "block_ids": ids},
            {"kind": "commit", "seq_id": seq, "num_tokens": len(tokens)}]


def _counters(new: tuple[int, int, int], resumed: tuple[int, int, int]) -> dict[str, int]:
    names = ("requests", "queries", "hits", "preempted_requests", "preempted_queries",
             "preempted_hits")
    return dict(zip(names, (*new, *resumed), strict=True))


@pytest.mark.parametrize(("counted_as", "found"), [
    pytest.param("resumed", [], id="resumption-counted-as-resumed"),
    pytest.param("new", ["stats"], id="resumption-counted-as-new")])
def test_a_resumed_admission_counts_in_the_resumed_counters(counted_as: str,
                                                            found: list[str]) -> None:
    a = list(range(100, 112))
    after = _counters((2, 24, 8), (0, 0, 0)) if counted_as == "new" else \
        _counters((1, 12, 0), (1, 12, 8))
    reports = [
        _report(ops.admit("A", a), _admit("A", a, 0, [1, 2, 3]), _counters((1, 12, 0),
                (0, 0, 0)), value={"reused_tokens": 0}, used=3),
        _report(ops.preempt("A"), [{"kind": "free", "seq_id": "A"}],
                _counters((1, 12, 0), (0, 0, 0)), preempted=("A",)),
        _report(ops.admit("A", a), _admit("A", a, 8, [1, 2, 4]), after,
                value={"reused_tokens": 8}, used=3)]
    judge = Judge(VLLM, 8)
    got = [v.oracle for r in reports for v in judge.observe(r)]
    assert got == found


# -- the eviction order -----------------------------------------------------------------------


def _free_queue_run(ids_c: list[int], reused_a2: int, ids_a2: list[int]) -> list[Violation]:
    """A and B (3 blocks each) computed and freed, A first, in a pool of 10; C (5 blocks)
    is given `ids_c`; A's prompt and one token more reuses `reused_a2`."""
    a, b, c = list(range(100, 112)), list(range(300, 312)), list(range(500, 520))
    steps: list[StepReport] = []
    for seq, tokens, ids in (("A", a, [1, 2, 3]), ("B", b, [4, 5, 6])):
        steps.append(_report(ops.admit(seq, tokens), _admit(seq, tokens, 0, ids), {},
                             value={"reused_tokens": 0}, used=3))
        steps.append(_report(ops.free(seq), [{"kind": "free", "seq_id": seq}], {}))
    steps.append(_report(ops.admit("C", c), _admit("C", c, 0, ids_c), {},
                         value={"reused_tokens": 0}, used=5))
    steps.append(_report(ops.free("C"), [{"kind": "free", "seq_id": "C"}], {}))
    steps.append(_report(ops.admit("A2", [*a, 1]), _admit("A2", [*a, 1], reused_a2, ids_a2),
                         {}, value={"reused_tokens": reused_a2}, used=4))
    judge = Judge(replace(VLLM, events=False, counters=()), 10)
    return [v for r in steps for v in judge.observe(r)]


def test_the_judge_follows_the_free_queue_and_stays_exact_after_an_eviction() -> None:
    # C takes the 4 never-used blocks and A's last (A was freed first, its tail first)
    assert _free_queue_run([7, 8, 9, 10, 3], 8, [1, 2, 6, 5]) == []


def test_an_allocation_off_the_free_queue_is_an_eviction_finding() -> None:
    got = _free_queue_run([7, 8, 9, 10, 6], 8, [1, 2, 3, 5])  # B's last block instead
    assert [v.oracle for v in got][:1] == ["eviction"]
    assert "admission of 'C' got blocks [7, 8, 9, 10, 6]; the free queue's front is " \
           "[7, 8, 9, 10, 3]" in got[0].message


def test_after_an_eviction_the_count_oracle_is_exact_where_the_order_is_known() -> None:
    # A's last block went to C: a cache that still finds it there reads C's KV
    got = _free_queue_run([7, 8, 9, 10, 3], 12, [1, 2, 3, 6])
    assert [v.oracle for v in got] == ["count", "provenance"]
    assert "reused 12 tokens; the count oracle predicts 8" in got[0].message


def test_uncached_blocks_go_to_the_front_where_the_policy_says_so() -> None:
    q = FreeQueue(6, B, uncached_first=True)
    events = [{"kind": "admit", "seq_id": "A", "tokens": list(range(6)), "num_tokens": 0,
               "scope": None, "block_ids": [1, 2]},
              {"kind": "commit", "seq_id": "A", "num_tokens": 6},
              {"kind": "free", "seq_id": "A"}]
    for e in events:
        assert q.apply(normalize_event(e)).problem is None
    assert list(q.queue) == [2, 3, 4, 5, 6, 1]  # block 2 holds 2 tokens: cached nothing
    plain = FreeQueue(6, B, uncached_first=False)
    for e in events:
        plain.apply(normalize_event(e))
    assert list(plain.queue) == [3, 4, 5, 6, 2, 1]


# -- router events: a block gone and stored again ------------------------------------------


def _stored(h: str, parent: str | None, tokens: list[int]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": tokens, "block_size": B, "salt": None, "lora_id": None,
            "medium": "GPU"}


@pytest.mark.parametrize(("copies", "allocated", "found"), [
    pytest.param(1, 0, ["events"], id="its-only-copy-gone-then-stored"),  # SGLang 0.5.5's
    pytest.param(2, 0, [], id="one-of-two-copies-replaced"),
    pytest.param(1, 1, [], id="evicted-then-computed-again")])
def test_a_step_that_removes_a_block_and_stores_it_again(copies: int, allocated: int,
                                                         found: list[str]) -> None:
    """A router folding a step's events one by one sees a block gone only when every
    copy was removed (a cache that keeps copies, vLLM's hybrid groups or duplicates,
    may evict one and store another while the block stays cached), and a step that
    allocated a block may evict the cached copy of what it computes again in it."""
    a = list(range(100, 104))
    c = replace(VLLM, counters=(), eviction_policy="lru-leaves")  # no order model
    steps = [StepReport(ops.admit(seq, a), "done", {"reused_tokens": 0}, "",
                        tuple(_admit(seq, a, 0, [i + 1])), (_stored("h", None, a),), i + 1,
                        ("h",) * (i + 1), Stats({}, {}))
             for i, seq in enumerate(["A", "B"][:copies])]
    removed_stored = ({"type": "BlockRemoved", "block_hashes": ["h"], "medium": "GPU"},
                      _stored("h", None, a))
    if allocated:  # A freed; C computes A's tokens again in a block of its own
        steps.append(StepReport(ops.free("A"), "done", None, "",
                                ({"kind": "free", "seq_id": "A"},), (), 0, ("h",),
                                Stats({}, {}), (), ()))
        steps.append(StepReport(ops.admit("C", a), "done", {"reused_tokens": 0}, "",
                                tuple(_admit("C", a, 0, [2])), removed_stored, 1, ("h",),
                                Stats({}, {})))
    else:
        steps.append(StepReport(ops.reserve("A", 4), "done", 4, "", (), removed_stored,
                                copies, ("h",) * copies, Stats({}, {})))
    judge = Judge(c, 8)
    got = [v for r in steps for v in judge.observe(r)]
    assert [v.oracle for v in got] == found, got
    assert all("a router folding in between sees the prefix gone" in v.message for v in got)


# -- a hybrid cache's window group --------------------------------------------------------


def test_the_window_group_holds_the_blocks_the_next_tokens_see() -> None:
    """vLLM 0.33.0's numbers (window 8, blocks of 4): 24 tokens in chunks of 8, then
    decode; B reuses 28 tokens of A's 30."""
    g = WindowGroup(8, B)
    held = []

    def step(kind: str, seq: str, **fields: Any) -> None:
        g.apply(normalize_event({"kind": kind, "seq_id": seq, **fields}))
        held.append(g.held())

    step("admit", "A", tokens=list(range(24)), num_tokens=0, scope=None, block_ids=[1, 2])
    step("commit", "A", num_tokens=8)
    for end, ids in ((16, [5, 6]), (24, [9, 10])):
        step("append", "A", tokens=[], block_ids=ids)
        step("commit", "A", num_tokens=end)
    for i, ids in enumerate(([13], [], [], [], [15])):
        step("append", "A", tokens=[900 + i], block_ids=ids)
        step("commit", "A", num_tokens=25 + i)
    assert held == [2, 2, 4, 4, 4, 4, 3, 3, 3, 3, 3, 3, 2, 2, 3, 3]
    step("free", "A")
    step("admit", "B", tokens=list(range(30)), num_tokens=28, scope=None,
         block_ids=[1, 2, 5, 6, 9, 10, 13, 16])
    assert held[-2:] == [0, 3]  # the hit's window: blocks from (28 - 7) // 4 = 5 on


def test_a_window_block_two_sequences_share_is_one_block() -> None:
    g = WindowGroup(8, B)
    for seq, ids, reused in (("A", [1, 2], 0), ("B", [1, 3], 4)):
        g.apply(normalize_event({"kind": "admit", "seq_id": seq, "tokens": list(range(8)),
                                 "num_tokens": reused, "scope": None, "block_ids": ids}))
    assert g.held() == 3  # B reuses A's first block in both groups


def test_a_window_group_off_the_rule_is_a_capacity_finding() -> None:
    c = replace(VLLM, window=8, window_layout="full-and-window", events=False, counters=())
    a = list(range(100, 124))
    log = [{"kind": "admit", "seq_id": "A", "tokens": a, "num_tokens": 0, "scope": None,
            "block_ids": [1, 2, 3, 4, 5, 6]},
           {"kind": "commit", "seq_id": "A", "num_tokens": 24}]
    def admitted(window: int) -> StepReport:
        return StepReport(ops.admit("A", a), "done", {"reused_tokens": 0}, "", tuple(log), (),
                          6 + window, None, Stats({}, {"windowNumBlocks": window}))
    assert Judge(c, 32).observe(admitted(6)) == []  # nothing computed yet: all six
    got = Judge(c, 32).observe(admitted(2))
    assert [v.oracle for v in got] == ["capacity"]
    assert "the window group holds 2 blocks (windowNumBlocks); its live sequences need 6" \
        in got[0].message


# -- cache options ------------------------------------------------------------------------


def test_cache_options_are_checked_and_an_engine_refuses_those_it_does_not_honour() -> None:
    assert CacheOptions.from_dict({"window": 8}).names() == ("window",)
    with pytest.raises(ValueError, match=r"options: CacheOptions.window must be an int "
                                         r">= 1 or None, got 0"):
        CacheOptions.from_dict({"window": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        CacheOptions.from_dict({"sliding": 8})
    engine = kvcache.load()
    with pytest.raises(ValueError, match=r"does not honour the cache options "
                                         r"\['chunk_budget'\] \(it honours \['host_blocks', "
                                         r"'state_interval'\]\)"):
        open_cache(engine, 8, B, True, CacheOptions(chunk_budget=8))
    result = run_check(LocalTarget(engine), check_named("scheduler_chunks"))
    assert result.status == "skip" and "the caller chooses each chunk" in result.message


def test_a_family_drops_an_optional_option_the_engine_lacks_and_judges_what_it_opens(
        ) -> None:
    """SGLang's scheduler has no long-prefill threshold and cuts its own chunks only
    under a budget: scheduler_chunks opens it with the budget alone and judges the
    contract of that cache, not of one opened without options."""
    check = check_named("scheduler_chunks")
    plain = replace(kvcache.contract(B), chunking="caller-page-floor",
                    options=("chunk_budget",))
    budgeted = replace(plain, chunking="page-budget", chunk_budget=8)
    assert check.options_for(plain) == CacheOptions(chunk_budget=8)
    opened: list[CacheOptions] = []
    assert check.skip_reason(plain, lambda o: opened.append(o) or budgeted) is None
    assert opened == [CacheOptions(chunk_budget=8)]
    assert "the caller chooses each chunk" in str(check.skip_reason(plain))
    both = replace(plain, options=("chunk_budget", "long_prefill_threshold"))
    assert check.options_for(both) == policy_families.CHUNKS


@pytest.mark.parametrize(("chunking", "threshold", "others", "chunks"), [
    pytest.param("page-budget", None, False, [8, 8, 8, 6], id="page-budget-alone"),
    pytest.param("page-budget", None, True, [8, 8, 8, 6], id="page-budget-beside"),
    pytest.param("token-budget", 6, False, [6, 6, 6, 6, 6], id="token-budget"),
    pytest.param("token-budget-shared", 6, False, [8, 8, 8, 6], id="shared-alone"),
    pytest.param("token-budget-shared", 6, True, [6, 6, 6, 6, 6], id="shared-beside")])
def test_the_chunk_model_follows_the_contracts_rule(chunking: str, threshold: int | None,
                                                    others: bool, chunks: list[int]) -> None:
    """A 30-token prompt under a budget of 8: SGLang's page budget takes no threshold and
    nothing for the other requests."""
    run = Run(LocalTarget(kvcache.load()), 8)
    run.contract = replace(run.contract, chunking=chunking, chunk_budget=8,
                           long_prefill_threshold=threshold)
    got, left = [], 30
    while left:
        got.append(policy_families._chunk(run, left, others))
        left -= got[-1]
    assert got == chunks


@pytest.mark.parametrize(("asked", "budget"), [
    pytest.param(8, 8, id="whole-pages"), pytest.param(6, 4, id="cut-to-a-page"),
    pytest.param(3, 4, id="at-least-a-page"), pytest.param(None, None, id="no-budget")])
def test_sglang_runs_a_chunk_budget_a_server_takes(asked: int | None,
                                                  budget: int | None) -> None:
    assert sglang_scheduler.server_budget(asked, B) == budget


def test_a_contract_refuses_bad_policy_fields() -> None:
    c = kvcache.contract(B)
    for field, bad in (("eviction_policy", "fifo"), ("preemption", "maybe"),
                       ("chunking", "scheduler"), ("event_fields", ("hash",)),
                       ("window", 0), ("replicated", (("what", "where"),))):
        with pytest.raises(ValueError, match=f"Contract.{field}"):
            replace(c, **{field: bad})
    assert Contract.from_dict(VLLM.as_dict()) == VLLM
    for budget, threshold in ((None, None), (6, None), (8, 6)):
        with pytest.raises(ValueError, match=r"Contract.chunking 'page-budget' needs a "
                                             r"chunk_budget of whole blocks \(4 tokens\)"):
            replace(c, chunking="page-budget", chunk_budget=budget,
                    long_prefill_threshold=threshold)


# -- the families on kvcache, and the faults they catch ---------------------------------------


@pytest.mark.parametrize("check", [c.name for c in policy_families.CHECKS])
def test_kvcache_passes_or_skips_each_policy_family(check: str) -> None:
    result = run_check(LocalTarget(kvcache.load()), check_named(check))
    want = "skip" if check in ("scheduler_chunks", "sliding_window", "window_off_page",
                               "window_pool_short") \
        else "pass"
    assert result.status == want, (result.oracle, result.message)


class ForgetsOnPreempt(KvcacheCache):
    """A preemption that drops what the sequence computed from the cache."""

    def preempt(self, seq_id: Hashable) -> None:
        super().preempt(seq_id)
        self.manager.reset_cache()


class WrongLoraInEvents(KvcacheCache):
    """Router events that name another LoRA id than the request's."""

    def take_events(self) -> list[dict[str, Any]]:
        return [{**e, "lora_id": 7} if e.get("lora_id") else e for e in super().take_events()]


class RefusesDecodes(KvcacheCache):
    """Every decode step refused, blocks free or not."""

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        return None


@pytest.mark.parametrize(("fault", "check", "oracle"), [
    pytest.param(ForgetsOnPreempt, "preemption_resume", "count", id="preempt-forgets"),
    pytest.param(WrongLoraInEvents, "event_fields", "scenario", id="events-wrong-lora"),
    pytest.param(RefusesDecodes, "decode_preempts", "capacity",
                 id="decode-refused-with-room"),
])
def test_a_planted_fault_fails_its_family(fault: type[KvcacheCache], check: str,
                                          oracle: str) -> None:
    result = run_check(LocalTarget(kvcache.load(fault)), check_named(check))
    assert (result.status, result.oracle) == ("fail", oracle), result.message


def test_the_fuzz_preempts_and_resumes_where_the_contract_can() -> None:
    target = LocalTarget(kvcache.load())
    runs = [fuzz(target, seed) for seed in (0, 7)]  # seeds that preempt
    kinds = [op.kind for run in runs for op in run.ops]
    assert "preempt" in kinds and all(run.violation is None for run in runs)
    resumed = [op for run in runs for i, op in enumerate(run.ops) if op.kind == "admit"
               and any(o.kind == "preempt" and o.seq == op.seq for o in run.ops[:i])]
    assert resumed
    quiet = LocalTarget(kvcache.load(NoPreemption))
    assert "preempt" not in {op.kind for op in fuzz(quiet, 0).ops}


def test_a_window_group_store_is_placed_on_the_full_groups_chain() -> None:
    """vLLM 0.33.0 publishes a window group's blocks (group_idx 1) under the request's
    hash of the block before them (block_pool.py cache_full_blocks): the full group's
    chain. A window store under a block that is not the one before it is an events
    finding, as a full-group store's is; the full group's own stores are folded first,
    whatever the order of the step's events."""
    c = replace(VLLM, window=8, window_layout="full-and-window", events=True, counters=(),
                event_fields=(*VLLM.event_fields, "group_idx"))
    a = list(range(100, 108))
    log = [{"kind": "admit", "seq_id": "A", "tokens": a, "num_tokens": 0, "scope": None,
            "block_ids": [1, 2]}, {"kind": "commit", "seq_id": "A", "num_tokens": 8}]

    def stored(h: str, parent: str | None, tokens: list[int], group: int) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                "token_ids": tokens, "block_size": B, "salt": None, "lora_id": None,
                "medium": "GPU", "group_idx": group}

    def run(*window: dict[str, Any]) -> list[Any]:
        full = (stored("h1", None, a[:4], 0), stored("h2", "h1", a[4:], 0))
        report = StepReport(ops.admit("A", a), "done", {"reused_tokens": 0}, "", tuple(log),
                            (*window, *full), 4, ("h1", "h2", "h1", "h2"),
                            Stats({}, {"windowNumBlocks": 2}))
        return Judge(c, 32).observe(report)

    assert run(stored("h1", None, a[:4], 1), stored("h2", "h1", a[4:], 1)) == []
    found = run(stored("h1", None, a[:4], 1), stored("h2", None, a[4:], 1))
    assert [(v.oracle, v.kind) for v in found] == [("events", "parent")]
    assert "the window group's BlockStored ['h2'] under parent None" in found[0].message
    found = run(stored("h1", None, a[:4], 1), stored("h2", "404", a[4:], 1))
    assert "names parent 404, which is not cached" in found[0].message
