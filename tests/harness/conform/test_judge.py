"""The judge's oracles each catch the fault they exist for, on kvcache's real manager
with one deliberate fault in its adapter (tests/harness/conform/faults.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.conform import ops
from harness.conform.adapters import kvcache
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.controller.checks import check_named
from harness.conform.controller.families import B
from harness.conform.controller.judge import Judge
from harness.conform.controller.runner import fuzz_check, run_check
from harness.conform.controller.targets import LocalTarget, Target, replay
from harness.conform.protocol import Scope, lora_id_text
from tests.harness.conform import faults

A18 = list(range(100, 118))


def oracles(target: Target, op_list: list[ops.Op], num_blocks: int = 32) -> list[str]:
    return [v.oracle for v in replay(target, op_list, num_blocks, B)]


def test_a_clean_run_finds_nothing() -> None:
    target = LocalTarget(kvcache.load())
    op_list = [ops.admit("A", A18), ops.commit("A", 18), ops.free("A"),
               ops.admit("B", A18, Scope(salt="1")), ops.commit("B", 18), ops.free("B"),
               ops.admit("C", A18), ops.append("C", [7, 8]), ops.commit("C", 20),
               ops.free("C")]
    assert oracles(target, op_list) == []


def test_sharing_between_scopes_is_a_count_and_a_provenance_violation() -> None:
    target = LocalTarget(kvcache.load(faults.SaltIsLora))
    op_list = [ops.admit("A", A18, Scope.lora("x", 1)), ops.commit("A", 18), ops.free("A"),
               ops.admit("B", A18, Scope(salt="1")), ops.commit("B", 18)]
    found = replay(target, op_list, 32, B)
    assert [v.oracle for v in found] == ["count", "provenance"]
    assert found[0].step == 3
    assert "reused 17 tokens; the count oracle predicts 0" in found[0].message
    assert "scope" in found[1].message  # the shadow store names whose KV it read


def test_a_refusal_that_moves_a_counter_changed_the_cache() -> None:
    target = LocalTarget(kvcache.load(faults.CountsRefusals))
    op_list = [ops.admit("A", list(range(24))), ops.admit("B", list(range(50, 66)))]
    found = replay(target, op_list, 8, B)
    assert [v.oracle for v in found] == ["refusal"]
    assert "engine counters {'lookups': (1, 2)}" in found[0].message


def test_a_refusal_with_the_blocks_there_is_unfair() -> None:
    target = LocalTarget(kvcache.load(faults.RefusesEarly))
    found = replay(target, [ops.admit("A", list(range(16))), ops.admit("B", list(range(50, 58)))],
                   8, B)
    assert [v.oracle for v in found] == ["capacity"]
    # the capacity oracle's own refusal check (CapacityOracle.check_refusal)
    assert "admit(B, 8 tokens 50..57) was refused although its blocks are there" \
        in found[0].message
    assert "needs 2, 4 of 8 free or evictable" in found[0].message


def test_unpublished_blocks_break_the_event_index() -> None:
    target = LocalTarget(kvcache.load(faults.SilentStores))
    found = replay(target, [ops.admit("A", A18), ops.commit("A", 18)], 32, B)
    assert [v.oracle for v in found] == ["events"]
    assert "the events say 0 blocks are cached, the cache holds 4" in found[0].message


@pytest.mark.parametrize(("fault", "says"), [
    pytest.param(faults.StoresAsRoots, "the parent is not the block right before them",
                 id="root"),
    pytest.param(faults.StoresUnderUnknownParent, "names parent 404, which is not cached",
                 id="unknown")])
def test_a_block_stored_under_another_parent_is_an_events_violation(
        fault: type[KvcacheCache], says: str) -> None:
    # the second commit stores A's second block, whose parent is A's first
    op_list = [ops.admit("A", range(100, 108)), ops.commit("A", 4), ops.commit("A", 8),
               ops.free("A")]
    assert oracles(LocalTarget(kvcache.load()), op_list) == []  # the right parent
    found = replay(LocalTarget(kvcache.load(fault)), op_list, 32, B)
    assert [(v.oracle, v.kind, v.step) for v in found] == [("events", "parent", 2)]
    assert says in found[0].message


def test_an_engine_that_raises_is_reported_with_where() -> None:
    target = LocalTarget(kvcache.load(faults.RaisesOnAppend))
    found = replay(target, [ops.admit("A", A18), ops.append("A", [1])], 32, B)
    assert found[0].oracle == "api"
    assert "AttributeError: 'LoRARequest' object has no attribute 'id'" in found[0].message
    assert "faults.py" in found[0].message  # where it was raised


def test_after_an_engine_raised_the_judge_keeps_judging_in_step() -> None:
    # B's admission raised once the engine had admitted it, before its log was written:
    # the engine holds B's 4 blocks, which no model knows of. The capacity oracle says
    # so and stops; C, admitted after, is in no capacity model, and its refused append is
    # not judged by one (it was asked of the stopped model, which raised "not live")
    target = LocalTarget(kvcache.load(faults.raises_at("admit", "unlogged")))
    judge = Judge(target.open(8, B), 8)
    op_list = [ops.admit("A", range(100, 104)), ops.admit("B", range(200, 216)),
               ops.admit("C", range(300, 304)), ops.append("C", range(400, 412))]
    reports = [target.apply(op) for op in op_list]
    assert [r.status for r in reports] == ["done", "raised", "done", "refused"]
    found = [v for r in reports for v in judge.observe(r)]
    assert [(v.oracle, v.kind, v.step) for v in found] == [
        ("api", "raised RuntimeError", 1), ("capacity", "used blocks", 1),
        ("stats", "counter", 1)]
    assert "expected  1 (0 held in the cache, 1 private)\n  actual    5" in found[1].message


def test_the_events_of_a_step_that_raised_are_folded() -> None:
    # the second commit stores A's second block and publishes it, then raises: the
    # engine's events of that step are the router's view all the same, so the index
    # takes them and agrees with the cache after it (judged on its status alone, it
    # would be one block short from then on: an events finding that is not the engine's)
    target = LocalTarget(kvcache.load(faults.raises_at("commit", "logged")))
    judge = Judge(target.open(32, B), 32)
    op_list = [ops.admit("A", range(100, 108)), ops.commit("A", 4), ops.commit("A", 8),
               ops.free("A")]
    reports = [target.apply(op) for op in op_list]
    assert [r.status for r in reports] == ["done", "done", "raised", "done"]
    assert [e.get("type") for e in reports[2].events] == ["BlockStored"]
    found = [v for r in reports for v in judge.observe(r)]
    assert [(v.oracle, v.step) for v in found] == [("api", 2)]
    assert sum(judge.index.counts.values()) == 2


@pytest.mark.parametrize("when", ["before", "logged", "unlogged"])
@pytest.mark.parametrize("kind", ops.KINDS)
def test_every_way_an_engine_raises_is_judged_to_the_end(kind: str, when: str) -> None:
    # the second call of `kind` raises: before the engine acted, or after, its log saying
    # so or not; the checks and the fuzz (each failure shrunk) run to their verdict, the
    # raise their first finding (Judge.observe checks its models stay in step)
    target = LocalTarget(kvcache.load(faults.raises_at(kind, when)))
    results = [run_check(target, check_named(name))
               for name in ("multi_turn", "chunked_admission")]
    results += [fuzz_check(target, seed) for seed in (0, 1)]
    failed = [r for r in results if r.status == "fail"]
    assert failed and all(r.oracle == "api" for r in failed), [r.message for r in failed]
    assert all(f"planted: {kind} raised" in r.message and r.ops[-1]["kind"] == kind
               for r in failed)


def test_a_prompt_that_claims_its_copy_source_under_pressure_is_no_finding() -> None:
    # B's first token matches A's first block, and with C live the pool has B's three
    # blocks only if B takes that block itself (docs/design.md, "Claim or copy"); the
    # count oracle's bounded model, which kvcache's contract asks for, once asserted
    # that the cache "admitted what cannot fit" here: a crash of the judge (it now
    # claims the copy source as kvcache does)
    target = LocalTarget(kvcache.load())
    op_list = [ops.admit("A", range(100, 112)), ops.commit("A", 9), ops.free("A"),
               ops.admit("C", range(500, 505)), ops.admit("B", [100, *range(900, 908)])]
    target.open(5, B)
    assert target.apply_all(op_list)[-1].value == {"reused_tokens": 1,
                                                   "block_ids": [2, 0, 1],
                                                   "scheduled_tokens": 9}
    assert oracles(target, op_list, 5) == []


def test_blocks_held_after_free_are_caught() -> None:
    target = LocalTarget(kvcache.load(faults.LeaksOnFree))
    found = replay(target, [ops.admit("A", A18), ops.commit("A", 18), ops.free("A")], 32, B)
    assert {v.oracle for v in found} >= {"capacity", "leaks"}
    leak = next(v for v in found if v.oracle == "leaks")
    # the plugin's leak check (harness.oracle.leaks.leak_problems) over the engine's report
    assert "nothing is live, yet: kvcache (_EngineReports): leaked: sequence 'A' is still " \
        "live, holding 5 blocks" in leak.message


def test_a_read_through_a_wrong_block_is_a_provenance_violation() -> None:
    target = LocalTarget(kvcache.load(faults.LogsWrongIds))
    found = replay(target, [ops.admit("A", A18), ops.commit("A", 18), ops.free("A"),
                            ops.admit("B", A18)], 32, B)
    assert [v.oracle for v in found][:1] == ["provenance"]


def test_an_oracle_reports_once() -> None:
    target = LocalTarget(kvcache.load(faults.SaltIsLora))
    judge = Judge(target.open(32, B), 32)
    op_list = [ops.admit("A", A18, Scope.lora("x", 1)), ops.commit("A", 18), ops.free("A")]
    op_list += [ops.admit(f"B{i}", A18, Scope(salt="1")) for i in range(3)]
    found = [v for op in op_list for v in judge.observe(target.apply(op))]
    assert [v.oracle for v in found].count("count") == 1


@pytest.mark.parametrize("fault", [faults.SaltIsLora], ids=["salt-is-lora"])
def test_the_scope_family_finds_the_fault(fault: type[KvcacheCache]) -> None:
    result = run_check(LocalTarget(kvcache.load(fault)), check_named("scope_isolation"))
    assert result.status == "fail" and result.oracle == "count"
    assert len(result.ops) <= 6  # shrunk to the two admissions and what they need
    assert any(op.get("scope") == {"salt": lora_id_text(1)} for op in result.ops)


EVICTING = [ops.admit("A", list(range(100, 116))), ops.commit("A", 16), ops.free("A"),
            ops.admit("B", list(range(500, 524))), ops.commit("B", 24), ops.free("B"),
            ops.admit("A2", [*range(100, 116), 1])]


def _judged(target: Target, op_list: list[ops.Op]) -> tuple[Judge, list[str]]:
    """`op_list` on a pool of 8 under `target`'s contract with no eviction model of its
    own (`bounded_oracle` off, as SGLang's: kvcache's says its count oracle models its
    evictions), so the judge learns each eviction from the events alone."""
    contract = replace(target.open(8, B), bounded_oracle=False)
    judge = Judge(contract, 8)
    found = [v.oracle for r in target.apply_all(op_list) for v in judge.observe(r)]
    return judge, found


def test_the_count_oracle_forgets_what_the_events_removed_and_stays_exact() -> None:
    """B (6 blocks) evicts two of A's 4 cached blocks, each a BlockRemoved whose chain
    the events spelled: the count oracle forgets them and still predicts A2's reuse
    exactly (8), where it used to become an upper bound."""
    judge, found = _judged(LocalTarget(kvcache.load()), EVICTING)
    assert found == [] and judge.exact
    assert judge.reuse.probe([*range(100, 116), 1]) == 8


def test_a_shortfall_after_an_eviction_is_a_count_violation() -> None:
    """The same run on an engine that, once it evicted, reuses nothing cached: A2 gets 0
    where 8 are cached, which an upper bound would have let pass."""
    _, found = _judged(LocalTarget(kvcache.load(faults.MissesAfterAnEviction)), EVICTING)
    assert found == ["count"]


def test_an_evicted_block_two_scopes_cached_leaves_the_count_oracle_an_upper_bound() -> None:
    """A's tokens cached in the default scope and under salt 'x' (one token run, two
    blocks each): which scope's block an eviction took is not one, so the count oracle
    falls back to an upper bound, and nothing is found."""
    a = list(range(100, 116))
    op_list = [ops.admit("A", a), ops.commit("A", 16), ops.free("A"),
               ops.admit("S", a, Scope(salt="x")), ops.commit("S", 16), ops.free("S"),
               ops.admit("C", list(range(500, 516))), ops.commit("C", 16), ops.free("C")]
    judge, found = _judged(LocalTarget(kvcache.load()), op_list)
    assert found == [] and not judge.exact
