"""The contract fields an engine like shortfin's trie needs, each judged as it says:
`unreused_tail`, `events`, `refusal_evicts`, `allocates_ahead`, `decode_steps`, and the
families a contract cannot be judged by (skipped, saying why). The judge is fed step
reports written by hand, so each number can be checked against the op list."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from harness.conform import ops
from harness.conform.adapters import kvcache
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.adapters.kvcache import contract as kvcache_contract
from harness.conform.adapters.shortfin import contract as shortfin_contract
from harness.conform.controller.checks import check_named
from harness.conform.controller.families import B, Run
from harness.conform.controller.fuzz import fuzz
from harness.conform.controller.judge import Judge, Violation
from harness.conform.controller.report import Report, markdown
from harness.conform.controller.runner import run_check
from harness.conform.controller.targets import LocalTarget
from harness.conform.ops import Op
from harness.conform.protocol import CacheOptions, Contract, Stats
from harness.conform.worker.session import Session, StepReport

A18 = list(range(100, 118))
# shortfin 3.9.0's: the last page never looked up, no events, refusals may evict, and
# decode pages taken ahead
TRIE = shortfin_contract("3.9.0", B)


def step(op: Op, log: list[dict[str, Any]], used: int, *, status: str = "done",
         value: Any = None, cached: int = 0, free: int = 0, ahead: int = 0,
         events: tuple[dict[str, Any], ...] = ()) -> StepReport:
    harness = {"usedNumBlocks": used, "cachedNumBlocks": cached, "freeNumBlocks": free,
               "aheadNumBlocks": ahead}
    return StepReport(op, status, value, "", tuple(log), events, used, None,  # type: ignore[arg-type]
                      Stats({}, harness))


def admitted(seq: str, tokens: list[int], reused: int, ids: list[int], used: int,
             **gauges: Any) -> StepReport:
    value = {"reused_tokens": reused, "block_ids": ids, "scheduled_tokens": len(tokens)}
    log = [{"kind": "admit", "seq_id": seq, "tokens": tokens, "num_tokens": reused,
            "scope": None, "block_ids": ids}]
    return step(ops.admit(seq, tokens), log, used, value=value, **gauges)


def computed_then_freed(seq: str, tokens: list[int], ids: list[int]) -> list[StepReport]:
    """`seq` admitted cold, committed whole and freed: its full blocks stay cached."""
    n, full = len(tokens), len(tokens) // B
    return [admitted(seq, tokens, 0, ids, len(ids), cached=0),
            step(ops.commit(seq, n), [{"kind": "commit", "seq_id": seq, "num_tokens": n}],
                 len(ids), cached=full),
            step(ops.free(seq), [{"kind": "free", "seq_id": seq}], 0, cached=full)]


def judged(contract: Contract, reports: list[StepReport], num_blocks: int = 32
           ) -> list[Violation]:
    judge = Judge(contract, num_blocks)
    return [v for r in reports for v in judge.observe(r)]


# -- unreused_tail ---------------------------------------------------------------------


@pytest.mark.parametrize(("tail", "reused", "found"), [
    pytest.param(4, 12, [], id="trie-12"),
    pytest.param(4, 16, ["count"], id="trie-16-past-its-cap"),
    pytest.param(1, 12, ["count"], id="reference-12-short"),
    pytest.param(1, 16, [], id="reference-16"),
    pytest.param(0, 16, [], id="whole-prompt-16")])
def test_the_count_oracle_caps_reuse_at_the_contracts_tail(tail: int, reused: int,
                                                            found: list[str]) -> None:
    contract = replace(TRIE, unreused_tail=tail)
    reports = computed_then_freed("A", A18, [0, 1, 2, 3, 4])
    ids = [0, 1, 2, 3, 5] if reused == 16 else [0, 1, 2, 5, 6]
    reports.append(admitted("A2", A18, reused, ids, 5, cached=4))
    got = judged(contract, reports)
    assert [v.oracle for v in got] == found
    if tail == 4 and found:
        assert "the last 4 prompt token(s) are never reused (at most 14)" in got[0].message
    if tail == 1 and found:
        assert "reused 12 tokens; the count oracle predicts 16" in got[0].message


def test_a_whole_prompt_contract_reuses_every_token() -> None:
    contract = replace(TRIE, unreused_tail=0)
    reports = computed_then_freed("A", A18[:16], [0, 1, 2, 3])
    reports.append(admitted("A2", A18[:16], 16, [0, 1, 2, 3], 4, cached=4))
    assert judged(contract, reports) == []
    got = judged(replace(contract, unreused_tail=1), reports)
    assert [v.oracle for v in got] == ["count"]
    assert "the last 1 prompt token(s) are never reused (at most 15)" in got[0].message


# -- events ----------------------------------------------------------------------------


def _evicted_then_readmitted(cached_after_evict: int) -> list[StepReport]:
    reports = computed_then_freed("A", A18, [0, 1, 2, 3, 4])
    reports.append(step(ops.evict(2), [], 0, value=2, cached=cached_after_evict))
    # the evicted blocks are gone: the cache reuses 8 where 12 were computed
    reports.append(admitted("A2", A18, 8, [0, 1, 5, 6, 7], 5, cached=cached_after_evict))
    return reports


def test_without_events_a_drop_in_cached_blocks_marks_an_eviction() -> None:
    assert judged(TRIE, _evicted_then_readmitted(2)) == []
    # nothing left the cache by its gauge: the reuse of 8 is a count violation
    got = judged(TRIE, _evicted_then_readmitted(4))
    assert [v.oracle for v in got] == ["count"]
    assert "reused 8 tokens; the count oracle predicts 12" in got[0].message


def test_an_engine_without_events_that_publishes_one_is_caught() -> None:
    stored = {"type": "BlockStored", "block_hashes": ["1"], "parent_block_hash": None,
              "token_ids": A18[:4], "block_size": B}
    reports = computed_then_freed("A", A18, [0, 1, 2, 3, 4])
    reports[1] = replace(reports[1], events=(stored,))
    got = judged(TRIE, reports)
    assert [v.oracle for v in got] == ["events"]
    assert "the contract says the engine publishes no events" in got[0].message


# -- refusal_evicts ----------------------------------------------------------------------


def _refusal_that_evicts(used_after: int) -> list[StepReport]:
    reports = computed_then_freed("A", A18[:16], [0, 1, 2, 3])
    reports = [replace(r, stats=Stats({}, {**r.stats.harness, "freeNumBlocks": 4}))
               for r in reports]
    big = list(range(500, 536))  # 9 blocks of a pool of 8: a fair refusal
    reports.append(step(ops.admit("C", big), [], used_after, status="refused", cached=2,
                        free=6))
    return reports


def test_a_refusal_may_evict_where_the_contract_says_so_and_nothing_else() -> None:
    assert judged(TRIE, _refusal_that_evicts(0), 8) == []
    got = judged(replace(TRIE, refusal_evicts=False), _refusal_that_evicts(0), 8)
    assert [v.oracle for v in got] == ["refusal"]
    assert "'cachedNumBlocks': (4, 2)" in got[0].message
    # what it pinned (used blocks) is a change whatever the contract says
    got = judged(TRIE, _refusal_that_evicts(2), 8)
    assert "refusal" in [v.oracle for v in got]
    assert "used blocks 0 -> 2" in got[0].message


# -- allocates_ahead ---------------------------------------------------------------------


@pytest.mark.parametrize(("ahead", "found"), [pytest.param(7, [], id="ahead-reported"),
                                              pytest.param(0, ["capacity"], id="unreported")])
def test_blocks_taken_ahead_are_the_engines_own_count(ahead: int, found: list[str]) -> None:
    reports = computed_then_freed("A", A18[:4], [0])[:2]
    append = [{"kind": "append", "seq_id": "A", "tokens": [7], "block_ids": [1]}]
    # the engine took 8 blocks for the decode step: 2 hold tokens, 7 wait ahead
    reports.append(step(ops.append("A", [7]), append, 9, value=[1], cached=1, ahead=ahead))
    assert [v.oracle for v in judged(TRIE, reports)] == found


# -- decode_steps ------------------------------------------------------------------------


class DecodeSteps(KvcacheCache):
    """kvcache's manager under a contract whose appends are one-token decode steps."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True,
                 options: CacheOptions | None = None) -> None:
        super().__init__(num_blocks, block_size, record=record, options=options)
        self._contract = replace(self._contract, decode_steps=True)


def test_a_decode_step_is_one_token_after_every_token_is_computed() -> None:
    session = Session(DecodeSteps(16, B))
    assert session.apply(ops.admit("A", A18[:6])).status == "done"
    early = session.apply(ops.append("A", [1]))
    assert (early.status, early.detail) == ("skipped", "append before all 6 tokens are "
                                            "computed (0): the engine decodes only after them")
    assert session.apply(ops.commit("A", 6)).status == "done"
    two = session.apply(ops.append("A", [1, 2]))
    assert (two.status, two.detail) == ("skipped", "append of 2 tokens: the engine decodes "
                                        "one per step")
    assert session.apply(ops.append("A", [1])).status == "done"


def test_the_fuzz_draws_decode_steps_under_such_a_contract() -> None:
    target = LocalTarget(kvcache.load(DecodeSteps))
    appends = [op for seed in range(6) for op in fuzz(target, seed).ops if op.kind == "append"]
    assert appends and all(len(op.tokens) == 1 for op in appends)


# -- families a contract cannot judge ----------------------------------------------------


class NoScopes(KvcacheCache):
    """kvcache's manager under a contract whose cache keys on no scope and publishes no
    events."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True) -> None:
        super().__init__(num_blocks, block_size, record=record)
        self._contract = replace(kvcache_contract(block_size), scope_kinds=(),
                                 lora_identity=(), scope_in_event_hash=(), events=False)

    def take_events(self) -> list[dict[str, Any]]:
        super().take_events()
        return []

    def cached_hashes(self) -> None:
        return None


def test_a_family_the_contract_cannot_judge_is_skipped_saying_why() -> None:
    target = LocalTarget(kvcache.load(NoScopes))
    result = run_check(target, check_named("scope_isolation"))
    assert (result.status, result.num_ops) == ("skip", 0)
    assert "keys its cache on no scope" in result.message
    both = run_check(target, check_named("scope_event_hashes"))
    assert "no scope" in both.message and "no router events" in both.message
    assert run_check(target, check_named("cold_then_warm")).status == "pass"
    report = Report("no-scopes", exit_code=0, checks=[result])
    assert "0 checks; 1 skipped" in "\n".join(markdown(report))


def test_a_warm_prompts_cap_follows_the_tail() -> None:
    run = Run(LocalTarget(kvcache.load(DecodeSteps)), 8)
    assert run.cap(18) == 17  # kvcache reuses partial blocks: all but the last token
    for tail, want in ((0, 16), (1, 16), (4, 12)):
        run.contract = replace(TRIE, unreused_tail=tail)
        assert run.cap(18) == want


def test_an_admissions_need_counts_only_the_blocks_its_lookup_reaches() -> None:
    from harness.oracle.capacity import CapacityOracle

    cap = CapacityOracle(B, 16)
    cap.apply({"kind": "admit", "seq_id": "A", "tokens": A18[:16], "num_tokens": 0})
    cap.apply({"kind": "commit", "seq_id": "A", "num_tokens": 16})
    # A holds 4 cached blocks: a reference lookup of 18 tokens reaches all 4 of them,
    # a trie lookup of all but the last page only 3, so one more block is needed
    assert cap.admission_need(A18, unreused_tail=1) == 5 - 4
    assert cap.admission_need(A18, unreused_tail=4) == 5 - 3
    assert cap.admission_need(A18, unreused_tail=0) == 5 - 4


# -- admission_reserve -------------------------------------------------------------------


@pytest.mark.parametrize(("held", "reserve", "need"), [
    pytest.param(16, 0, 1, id="4-free-no-reserve-its-chunk-fits"),
    pytest.param(16, 2, None, id="4-free-reserve-2-fair"),
    pytest.param(8, 2, 6, id="6-free-reserve-2-fits"),
    pytest.param(32, 0, None, id="none-free-fair")])
def test_a_refusal_is_judged_with_the_contracts_admission_reserve(
        held: int, reserve: int, need: int | None) -> None:
    """A pool of 8 with A holding `held` tokens; B (4 blocks, a first chunk of 1 token)
    is refused. Without a reserve a chunked engine needs the chunk's block; with one it
    needs the whole prompt and the reserve, whatever the chunk: the refusal is unfair
    (capacity) only when that many blocks are free."""
    contract = replace(kvcache_contract(B), partial_reuse=False, copy_on_partial_reuse=False,
                       chunked_allocation=True, counters=(), admission_reserve=reserve,
                       admission_fits="prompt" if reserve else "chunk")
    a = admitted("A", A18[:held] + list(range(900, 900 + max(0, held - 18))), 0,
                 list(range(held // B)), held // B)
    b = step(ops.admit("B", list(range(500, 516)), first_chunk=1), [], a.used_blocks,
             status="refused")
    got = judged(contract, [a, b], num_blocks=8)
    assert [v.oracle for v in got] == ([] if need is None else ["capacity"])
    if need is not None:
        assert f"admitted: needs {need}, {8 - held // B} of 8 free" in got[0].message


def test_an_admission_reserve_must_be_a_count() -> None:
    with pytest.raises(ValueError, match=r"Contract\.admission_reserve must be an int >= 0, "
                                         r"got -1"):
        replace(kvcache_contract(B), admission_reserve=-1)


# -- host_full_hit, host_load_reserve, host_stores, host_events ---------------------------

# a host tier as vLLM's connector fronts it: whole blocks, chunked allocation, the count
# oracle unbounded (exact until a block leaves), only prompt blocks stored, no router
# events or counters here
HOSTED = replace(kvcache_contract(B, CacheOptions(host_blocks=8)), partial_reuse=False,
                 copy_on_partial_reuse=False, bounded_oracle=False, chunked_allocation=True,
                 events=False, counters=(), host_stores="prompt-only")


@pytest.mark.parametrize(("rule", "found"), [
    pytest.param("all-but-last", [], id="all-but-last"),
    pytest.param("unreused-tail", ["count"], id="unreused-tail")])
def test_a_prompt_cached_whole_reuses_all_but_its_last_token_where_the_contract_says(
        rule: str, found: list[str]) -> None:
    """A (16 tokens) computed and freed; A again reuses 15: its last block loaded whole
    from the host, its last token computed again (vLLM 0.33.0). Under the reference
    that is no whole number of blocks."""
    reports = computed_then_freed("A", A18[:16], [0, 1, 2, 3])
    reports.append(admitted("A2", A18[:16], 15, [0, 1, 2, 3], 4, cached=4))
    got = judged(replace(HOSTED, host_full_hit=rule), reports, num_blocks=8)
    assert [v.oracle for v in got] == found
    if found:
        assert "reused 15 tokens: not whole blocks of 4" in got[0].message


def test_all_but_the_last_token_of_a_prompt_not_cached_whole_is_a_count_violation() -> None:
    """The rule covers a prompt cached whole only: 15 of a prompt whose last block was
    never computed is more than the cache holds."""
    reports = computed_then_freed("A", A18[:12], [0, 1, 2])
    reports.append(admitted("A2", A18[:16], 15, [0, 1, 2, 3], 4, cached=3))
    got = judged(replace(HOSTED, host_full_hit="all-but-last"), reports, num_blocks=8)
    assert [v.oracle for v in got][:2] == ["count", "provenance"]  # and it read no KV
    assert "reused 15 tokens; the count oracle predicts 12" in got[0].message


@pytest.mark.parametrize(("reused", "found"), [
    pytest.param(15, [], id="host-hit-15"),
    pytest.param(12, ["count"], id="device-hit-12")])
def test_a_prompt_cached_whole_on_the_host_reuses_all_but_its_last_token_only(
        reused: int, found: list[str]) -> None:
    """A (16 tokens, its prompt) computed and freed: the host holds all four blocks, so
    A again loads the last from there and reuses 15; the device's hit alone (12) is an
    engine that did not look at its host."""
    reports = computed_then_freed("A", A18[:16], [0, 1, 2, 3])
    ids = [0, 1, 2, 3 if reused == 15 else 4]  # a host load lands in A's last block
    reports.append(admitted("A2", A18[:16], reused, ids, 4, cached=4))
    got = judged(replace(HOSTED, host_full_hit="all-but-last"), reports, num_blocks=8)
    assert [v.oracle for v in got] == found
    if found:
        assert "reused 12 tokens; the count oracle predicts 15" in got[0].message


def decoded_then_preempted(stores: str, reused: int) -> list[Violation]:
    """A's prompt (12 tokens) computed, a decode of 4 filling its fourth block, A
    preempted, then resumed with all 16 (reusing `reused`), under `host_stores`."""
    decoded = A18[12:16]
    reports = [admitted("A", A18[:12], 0, [0, 1, 2], 3),
               step(ops.commit("A", 12), [{"kind": "commit", "seq_id": "A",
                                           "num_tokens": 12}], 3, cached=3),
               step(ops.append("A", decoded), [{"kind": "append", "seq_id": "A",
                                                "tokens": decoded, "block_ids": [3]}], 4,
                    cached=3),
               step(ops.commit("A", 16), [{"kind": "commit", "seq_id": "A",
                                           "num_tokens": 16}], 4, cached=4),
               replace(step(ops.preempt("A"), [{"kind": "free", "seq_id": "A"}], 0,
                            cached=4), preempted=("A",)),
               admitted("A", A18[:16], reused, [0, 1, 2, 3 if reused == 15 else 4], 4,
                        cached=4)]
    contract = replace(HOSTED, host_full_hit="all-but-last", host_stores=stores)
    return judged(contract, reports, num_blocks=8)


@pytest.mark.parametrize(("stores", "reused", "found"), [
    pytest.param("prompt-only", 12, [], id="prompt-only-device-hit"),
    pytest.param("prompt-only", 15, ["count"], id="prompt-only-not-on-the-host"),
    pytest.param("when-computed", 15, [], id="when-computed-host-hit"),
    pytest.param("when-computed", 12, ["count"], id="when-computed-device-hit")])
def test_a_block_a_decode_filled_is_on_the_host_only_where_the_contract_stores_it(
        stores: str, reused: int, found: list[str]) -> None:
    """vLLM stores no block past a request's prompt (`host_stores` "prompt-only"): A's
    decoded block, on the device when A is preempted, is not on the host, so A resumes
    with the device's hit (12), and 15 is a load of a block the host never got. Where
    every computed block is stored ("when-computed") it is the other way round."""
    got = decoded_then_preempted(stores, reused)
    assert [v.oracle for v in got] == found
    if found:
        assert f"reused {reused} tokens; the count oracle predicts {27 - reused}" \
            in got[0].message


@pytest.mark.parametrize(("rule", "found"), [
    pytest.param("inflight-prefills", [], id="inflight-prefills"),
    pytest.param("none", ["capacity"], id="none")])
def test_a_host_load_refused_for_what_a_prefill_in_flight_needs(
        rule: str, found: list[str]) -> None:
    """The shrunk vLLM 0.33.0 case, a pool of 3: S (one block) is computed and stays
    live; P (5 tokens) has its first chunk of 2 scheduled, one block of the two it needs;
    S2, S's prompt again, would load S's block from the host into the last free block,
    which P's prefill still needs: vLLM refuses it (host_load_reserve
    'inflight-prefills'); under 'none' the refusal is unfair."""
    s, p = [1, 2, 3, 3], [7, 8, 9, 10, 11]
    reports = [admitted("S", s, 0, [0], 1),
               step(ops.commit("S", 4), [{"kind": "commit", "seq_id": "S", "num_tokens": 4}],
                    1, cached=1),
               step(ops.admit("P", p, first_chunk=2),
                    [{"kind": "admit", "seq_id": "P", "tokens": p, "num_tokens": 0,
                      "scope": None, "block_ids": [1]}], 2, cached=1,
                    value={"reused_tokens": 0, "block_ids": [1], "scheduled_tokens": 2}),
               step(ops.admit("S2", s), [], 2, status="refused", cached=1)]
    got = judged(replace(HOSTED, host_load_reserve=rule), reports, num_blocks=3)
    assert [v.oracle for v in got] == found
    if found:
        assert "needs 1, 1 of 3 free or evictable" in got[0].message


# -- host_events ----------------------------------------------------------------------

# a host tier with router events: the device's carry their parent and tokens; the host's
# BlockStored as vLLM's connector publishes it before 0.24.0's self_describing_kv_events
# (offloading/scheduler.py take_events, 0.23.0 :1029-1048)
EVENTED = replace(HOSTED, events=True)


def device_stored(h: str, tokens: list[int], parent: str | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": tokens, "block_size": B, "salt": None, "lora_id": None, "medium": "GPU"}


def host_placeholder(h: str) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
            "token_ids": [], "block_size": 0, "salt": None, "lora_id": None,
            "medium": "CPU"}


def host_removed(h: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": "CPU"}


def stored_on_both(host: tuple[dict[str, Any], ...]) -> list[StepReport]:
    """A (8 tokens) admitted, committed (both blocks stored on the device and, as
    placeholders, on the host) and freed, whose free publishes `host`."""
    tokens = A18[:8]
    return [admitted("A", tokens, 0, [0, 1], 2),
            step(ops.commit("A", 8), [{"kind": "commit", "seq_id": "A", "num_tokens": 8}],
                 2, cached=2, events=(device_stored("a1", tokens[:4]),
                                      device_stored("a2", tokens[4:], "a1"),
                                      host_placeholder("a1"), host_placeholder("a2"))),
            step(ops.free("A"), [{"kind": "free", "seq_id": "A"}], 0, cached=2,
                 events=host)]


@pytest.mark.parametrize(("events", "host", "found", "message"), [
    pytest.param("hashes-only", (), [], "", id="hashes-only-placeholders"),
    pytest.param("hashes-only", (host_removed("a2"),), [], "", id="hashes-only-removed"),
    pytest.param("self-describing", (), ["events"],
                 "BlockStored ['a1'] under parent None: its 0 tokens, then the 0 stored, "
                 "are no prefix", id="self-describing-placeholders")])
def test_a_host_block_stored_by_its_hash_alone_passes_where_the_contract_says(
        events: str, host: tuple[dict[str, Any], ...], found: list[str],
        message: str) -> None:
    """The host's BlockStored name no parent, no tokens and block size 0: under
    `host_events` "hashes-only" they are folded by hash (and a removal of one folds);
    under "self-describing" the first one is placed nowhere, as a router would."""
    got = judged(replace(EVENTED, host_events=events), stored_on_both(host), num_blocks=8)
    assert [v.oracle for v in got] == found
    if found:
        assert message in got[0].message


def test_a_host_block_removed_but_never_stored_is_an_events_violation_by_hash_alone(
        ) -> None:
    """Under "hashes-only" the host's events are still folded: a BlockRemoved of a hash
    the host never stored does not fold."""
    got = judged(replace(EVENTED, host_events="hashes-only"),
                 stored_on_both((host_removed("a3"),)), num_blocks=8)
    assert [v.oracle for v in got] == ["events"]
    assert "BlockRemoved names hash a3, which the host tier does not hold on CPU" \
        in got[0].message


def test_a_host_block_removed_and_stored_again_in_one_op_is_churn_by_hash_alone() -> None:
    """The host's blocks folded apart still count as cached: removing a2 and storing it
    again in the free is churn (a router between the two sees it gone)."""
    got = judged(replace(EVENTED, host_events="hashes-only"),
                 stored_on_both((host_removed("a2"), host_placeholder("a2"))), num_blocks=8)
    assert [v.oracle for v in got] == ["events"]
    assert "published BlockRemoved and BlockStored again for blocks it kept cached " \
        "(['a2'])" in got[0].message


@pytest.mark.parametrize(("base", "field", "value", "message"), [
    pytest.param("hosted", "host_events", "hashes",
                 r"Contract\.host_events must be one of \('self-describing', "
                 r"'hashes-only'\), got 'hashes'", id="events-choice"),
    pytest.param("trie", "host_events", "hashes-only",
                 r"Contract\.host_events 'hashes-only' is a host tier's rule, but the "
                 r"contract has no host tier", id="events-need-a-host"),
    pytest.param("hosted", "host_full_hit", "all",
                 r"Contract\.host_full_hit must be one of \('unreused-tail', "
                 r"'all-but-last'\), got 'all'", id="full-hit-choice"),
    pytest.param("hosted", "host_load_reserve", "prefills",
                 r"Contract\.host_load_reserve must be one of \('none', "
                 r"'inflight-prefills'\), got 'prefills'", id="load-reserve-choice"),
    pytest.param("hosted", "host_stores", "at-finish",
                 r"Contract\.host_stores must be one of \('on-eviction', 'when-computed', "
                 r"'prompt-only'\), got 'at-finish'", id="stores-choice"),
    pytest.param("trie", "host_stores", "prompt-only",
                 r"Contract\.host_stores 'prompt-only' is a host tier's rule, but the "
                 r"contract has no host tier", id="stores-needs-a-host"),
    pytest.param("trie", "host_load_reserve", "inflight-prefills",
                 r"Contract\.host_load_reserve 'inflight-prefills' is a host tier's rule, "
                 r"but the contract has no host tier", id="load-reserve-needs-a-host"),
])
def test_a_host_rule_is_a_closed_choice_and_needs_a_host_tier(
        base: str, field: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(HOSTED if base == "hosted" else TRIE, **{field: value})


def test_a_hosted_contract_round_trips() -> None:
    assert Contract.from_dict(HOSTED.as_dict()) == HOSTED
