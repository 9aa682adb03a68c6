"""A hybrid model's recurrent-state group under vLLM's chunk-end rule (`state_group`),
by hand-written logs with vLLM 0.33.0's numbers (blocks of 4, states every 2 blocks),
and the judge holding an engine to it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from harness.conform import ops
from harness.conform.adapters.sglang import contract as sglang_contract
from harness.conform.adapters.vllm import contract as vllm_contract
from harness.conform.controller.judge import Judge
from harness.conform.controller.state_group import (
    StateGroup,
    decode_keeps,
    extend_keeps,
    keeps,
)
from harness.conform.protocol import Contract, Stats
from harness.conform.worker.session import StepReport
from harness.oracle.types import normalize_event

B = 4


def _ev(kind: str, seq: str, **fields: Any) -> Any:
    return normalize_event({"kind": kind, "seq_id": seq, **fields})


def test_only_step_ends_on_a_state_block_keep_a_state() -> None:
    assert [n for n in range(1, 25) if keeps("chunk-ends", n, 22, 8, B)] == [8, 16, 24]
    # with partial hash hits also the prompt's last block boundary before its last token
    assert [n for n in range(1, 25) if keeps("chunk-ends-tail", n, 22, 8, B)] == [8, 16, 20, 24]
    assert keeps("chunk-ends-tail", 12, 14, 8, B)  # 14 tokens: (14 - 1) // 4 * 4
    assert not keeps("chunk-ends-tail", 12, 17, 8, B)  # 17 tokens: the tail stop is 16
    with pytest.raises(ValueError, match="rule must be one of"):
        StateGroup("every-k", 8, B)


def test_the_state_group_reuses_to_the_last_kept_state_as_vllm_documents() -> None:
    """What vLLM 0.33.0's scheduler did (docs/conformance.md): A's 20 tokens in a step of
    16 and one of 4; C's 22 in steps ending at 12, 20 and 22."""
    g = StateGroup("chunk-ends-tail", 8, B)
    a, c = list(range(100, 120)), list(range(300, 322))
    g.apply(_ev("admit", "A", tokens=a, num_tokens=0, scope=None, block_ids=[]))
    for end in (16, 20):
        g.apply(_ev("commit", "A", num_tokens=end))
    g.apply(_ev("free", "A"))
    assert g.cut([*a[:14], 500], None, 12) == 0  # the only state of A's is at 16
    assert g.cut([*a, 1], None, 20) == 16
    assert g.cut([*a, 1], "salted", 20) == 0  # another scope's states are not its own
    g.apply(_ev("admit", "C", tokens=c, num_tokens=0, scope=None, block_ids=[]))
    g.apply(_ev("commit", "C", num_tokens=12))
    assert g.cut([*c, 1], None, 12) == 0  # 12 ends no state block and is no tail
    for end in (20, 22):
        g.apply(_ev("commit", "C", num_tokens=end))
    assert g.cut([*c, 1], None, 20) == 20  # (22 - 1) // 4 * 4: C's tail stop
    plain = StateGroup("chunk-ends", 8, B)
    plain.apply(_ev("admit", "C", tokens=c, num_tokens=0, scope=None, block_ids=[]))
    plain.apply(_ev("commit", "C", num_tokens=20))
    assert plain.cut([*c, 1], None, 20) == 0  # without partial hits no tail state


def _mamba_contract() -> Contract:
    return replace(vllm_contract("0.33.0", B, True), state_interval=2,
                   state_rule="chunk-ends-tail", events=False, counters=())


def _report(op: Any, value: Any, log: list[dict[str, Any]], used: int, states: int
            ) -> StepReport:
    return StepReport(op, "done", value, "", tuple(log), (), used, None,
                      Stats({}, {"stateNumBlocks": states}))


def test_the_judge_holds_a_chunk_end_engine_to_its_kept_states() -> None:
    """A computed in one step of 16 then one of 4 keeps its state at 16 only: B sharing
    its first 14 tokens reuses 0, where the every-k rule says 8; an engine giving 8
    (a state it never kept at a step's end) is a count finding."""
    a, b = list(range(100, 120)), [*range(100, 114), *range(500, 506)]

    def run(reused: int) -> list[Any]:
        j = Judge(_mamba_contract(), 32)
        got = j.observe(_report(ops.admit("A", a), {"reused_tokens": 0}, [
            {"kind": "admit", "seq_id": "A", "tokens": a, "num_tokens": 0, "scope": None,
             "block_ids": [1, 2, 3, 4]},
            {"kind": "commit", "seq_id": "A", "num_tokens": 16}], 5, 1))
        got += j.observe(_report(ops.reserve("A", 20), 20, [
            {"kind": "append", "seq_id": "A", "tokens": [], "block_ids": [5]},
            {"kind": "commit", "seq_id": "A", "num_tokens": 20}], 6, 1))
        got += j.observe(_report(ops.free("A"), None, [{"kind": "free", "seq_id": "A"}], 0, 0))
        ids = [1, 2, 7, 8, 9] if reused else [7, 8, 9, 10, 11]
        got += j.observe(_report(ops.admit("B", b), {"reused_tokens": reused}, [
            {"kind": "admit", "seq_id": "B", "tokens": b, "num_tokens": reused,
             "scope": None, "block_ids": ids}], 6, 1))
        return got

    assert run(0) == []
    found = run(8)
    assert [(v.oracle, v.kind) for v in found] == [("count", "reuse")]
    assert "predicts 0 (its full-attention match cut to the last recurrent state" \
        in found[0].message
    # the state group's blocks are left out of the used blocks as the gauge counts them
    assert Judge(_mamba_contract(), 32).states is not None
    assert Judge(replace(_mamba_contract(), state_rule="every-k"), 32).states is None


def test_a_contract_refuses_an_unknown_state_rule() -> None:
    with pytest.raises(ValueError, match=r"Contract\.state_rule"):
        replace(_mamba_contract(), state_rule="chunks")
    c = _mamba_contract()
    assert Contract.from_dict(c.as_dict()) == c


def _stored(hashes: list[str], parent: str | None, tokens: list[int], size: int,
            group: int) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": size, "salt": None, "lora_id": None,
            "medium": "GPU", "group_idx": group}


def test_the_judge_folds_the_state_groups_events_apart_and_the_full_groups_as_before(
        ) -> None:
    """vLLM 0.33.0 publishes the Mamba group's blocks (group_idx 1) in blocks of 8 with
    hashes of their own, and partial entries on the full group's chain: the judge folds
    them apart, by hash, and holds the full group's events to the index as before."""
    a = list(range(100, 120))
    contract = replace(_mamba_contract(), events=True,
                       event_fields=(*_mamba_contract().event_fields, "group_idx"))
    full = _stored(["h1", "h2", "h3", "h4"], None, a[:16], B, 0)

    def run(*events: dict[str, Any], cached: tuple[str, ...] = ()) -> list[Any]:
        j = Judge(contract, 32)
        log = [{"kind": "admit", "seq_id": "A", "tokens": a, "num_tokens": 0, "scope": None,
                "block_ids": [1, 2, 3, 4, 5]},
               {"kind": "commit", "seq_id": "A", "num_tokens": 16}]
        return j.observe(replace(_report(ops.admit("A", a), {"reused_tokens": 0}, log, 6, 1),
                                 events=events, cached=cached))

    state = _stored(["m2"], "m1", a[8:16], 2 * B, 1)  # its parent is no block it holds
    partial = _stored(["h4"], "h3", a[12:16], B, 1)  # the full group's hash, group 1's
    assert run(full, state, partial, cached=("h1", "h2", "h3", "h4", "m2", "h4")) == []
    found = run(full, state, cached=("h1", "h2", "h3", "h4"))
    assert [(v.oracle, v.kind) for v in found] == [("events", "cached blocks")]
    gone = {"type": "BlockRemoved", "block_hashes": ["m9"], "medium": "GPU", "group_idx": 1}
    found = run(full, gone)
    assert [(v.oracle, v.kind) for v in found] == [("events", "does not fold")]
    assert "hash m9, which group 1 does not hold" in found[0].message
    found = run(_stored(["h1"], None, a[:8], 2 * B, 0))  # the full group's, as before
    assert "block_size 8 != 4" in found[0].message
    found = run(_stored(["m2"], None, a[:8], 2 * B, 2))
    assert [(v.oracle, v.kind) for v in found] == [("events", "group")]


def test_vllm_0_28_keeps_the_prompts_last_hash_boundary_even_at_its_end() -> None:
    """0.28.0-0.29.0 stop a prompt at prompt // B * B (0.33.0 at (prompt - 1) // B * B):
    A's 20 tokens keep a state at 20, which A plus one token reuses."""
    rule = "chunk-ends-prompt-tail"
    assert [n for n in range(1, 25) if keeps(rule, n, 20, 8, B)] == [8, 16, 20, 24]
    assert [n for n in range(1, 25) if keeps(rule, n, 22, 8, B)] == [8, 16, 20, 24]
    assert not keeps("chunk-ends-tail", 20, 20, 8, B)
    g = StateGroup(rule, 8, B)
    a = list(range(100, 120))
    g.apply(_ev("admit", "A", tokens=a, num_tokens=0, scope=None, block_ids=[]))
    for end in (16, 20):
        g.apply(_ev("commit", "A", num_tokens=end))
    assert g.cut([*a, 1], None, 20) == 20
    assert replace(_mamba_contract(), state_rule=rule).state_rule == rule


def test_an_extend_keeps_one_state_or_its_branching_point() -> None:
    """SGLang 0.5.23's rule (schedule_batch.py:3175-3232), states every 8 tokens."""
    assert extend_keeps(0, 20, 8, None) == 16  # one state per extend, the last whole one
    assert extend_keeps(0, 7, 8, None) is None  # shorter than a state block: none
    assert extend_keeps(12, 22, 8, None) == 20  # on the extend's own grid, not 16
    assert extend_keeps(0, 20, 8, 8) == 8  # the branching point replaces it
    assert extend_keeps(4, 20, 8, 8) == 20  # unless it lies off the extend's grid
    assert extend_keeps(8, 20, 8, 8) == 16  # or is where the extend starts


def test_the_state_group_follows_sglang_one_state_per_extend() -> None:
    """What SGLang 0.5.23's scheduler code did on a CPU (docs/conformance.md, g = 8):
    A (20 tokens, one extend) keeps 16 only; B sharing A's first 14 reuses 0 and keeps
    the branching point 8 its match named; C cut at 12 keeps 8, and its next extend
    (12 to 22) keeps 20; B's one decoded token crosses no state block."""
    g = StateGroup("extend-end", 8, B)
    a, c = list(range(100, 120)), list(range(300, 322))
    b = [*a[:14], *range(500, 506)]
    g.apply(_ev("admit", "A", tokens=a, num_tokens=0, scope=None, block_ids=[]))
    g.apply(_ev("commit", "A", num_tokens=20))
    g.apply(_ev("free", "A"))
    assert g.cut(b, None, 12) == 0  # every-k and chunk-ends would keep 8 as well
    assert g.cut([*a, 1], None, 20) == 16
    g.matched("B", 12, 0)
    g.apply(_ev("admit", "B", tokens=b, num_tokens=0, scope=None, block_ids=[]))
    g.apply(_ev("commit", "B", num_tokens=20))
    g.apply(_ev("append", "B", tokens=[7]))
    g.apply(_ev("commit", "B", num_tokens=21))  # the decoded token, when B ends
    g.apply(_ev("free", "B"))
    assert g.cut([*b, 7, 1], None, 21) == 8  # at the branching point, not at 16
    assert g.cut([*a[:10], 1], None, 8) == 8
    g.apply(_ev("admit", "C", tokens=c, num_tokens=0, scope=None, block_ids=[]))
    g.apply(_ev("commit", "C", num_tokens=12))
    assert g.cut([*c, 1], None, 12) == 8
    g.apply(_ev("commit", "C", num_tokens=22))
    assert g.cut([*c, 1], None, 22) == 20
    assert g.cut([*c, 1], "salted", 22) == 0


def test_the_state_group_keeps_sglangs_last_decode_state_when_a_request_ends() -> None:
    """SGLang tracks a decode state every g tokens and a finished request gives the tree
    its last one (g = 8): A's prompt of 10 keeps 8, its decode to 17 tokens keeps 16
    (not 8, nor 17); E decoding from 10 to 15 crosses no state block and keeps none."""
    assert decode_keeps(10, 17, 8) == 16
    assert decode_keeps(10, 24, 8) == 24
    assert decode_keeps(10, 15, 8) is None
    assert decode_keeps(16, 17, 8) is None  # the prompt's own state is the extend's
    g = StateGroup("extend-end", 8, B)
    a, e = list(range(100, 110)), list(range(200, 210))
    g.apply(_ev("admit", "A", tokens=a, num_tokens=0, scope=None, block_ids=[]))
    g.apply(_ev("commit", "A", num_tokens=10))
    for t in range(7):
        g.apply(_ev("append", "A", tokens=[t]))
    g.apply(_ev("commit", "A", num_tokens=17))  # the decoded tokens, when A ends
    g.apply(_ev("free", "A"))
    assert g.cut([*a, *range(7), 1], None, 17) == 16
    assert g.cut([*a, 0, 1], None, 12) == 8  # a different continuation: the prompt's
    g.apply(_ev("admit", "E", tokens=e, num_tokens=0, scope=None, block_ids=[]))
    g.apply(_ev("commit", "E", num_tokens=10))
    for t in range(5):
        g.apply(_ev("append", "E", tokens=[t]))
    g.apply(_ev("commit", "E", num_tokens=15))
    g.apply(_ev("free", "E"))
    assert g.cut([*e, *range(5), 1], None, 15) == 8


def _sglang_contract(rule: str) -> Contract:
    return replace(sglang_contract("0.5.23", B), state_interval=2, state_rule=rule,
                   events=False, counters=())


def test_the_judge_holds_an_extend_end_engine_to_one_state_per_extend() -> None:
    """C (22 tokens) in extends of 12 and 10 keeps its states at 8 and 20 (12 + 8) under
    SGLang's rule, so D sharing all of C reuses 20; under vLLM's chunk-end rule neither
    extend ends on a state block and 20 is a count finding."""
    c = list(range(300, 322))

    def run(rule: str) -> list[Any]:
        j = Judge(_sglang_contract(rule), 32)
        got = j.observe(_report(ops.admit("C", c, None, 12), {"reused_tokens": 0}, [
            {"kind": "admit", "seq_id": "C", "tokens": c, "num_tokens": 0, "scope": None,
             "block_ids": [1, 2, 3]},
            {"kind": "commit", "seq_id": "C", "num_tokens": 12}], 3, 0))
        got += j.observe(_report(ops.reserve("C", 22), 22, [
            {"kind": "append", "seq_id": "C", "tokens": [], "block_ids": [4, 5, 6]},
            {"kind": "commit", "seq_id": "C", "num_tokens": 22}], 6, 0))
        got += j.observe(_report(ops.free("C"), None, [{"kind": "free", "seq_id": "C"}], 0, 0))
        got += j.observe(_report(ops.admit("D", [*c, 1]), {"reused_tokens": 20}, [
            {"kind": "admit", "seq_id": "D", "tokens": [*c, 1], "num_tokens": 20,
             "scope": None, "block_ids": [1, 2, 3, 4, 5, 7]}], 6, 0))
        return got

    assert run("extend-end") == []
    found = run("chunk-ends")
    assert [(v.oracle, v.kind) for v in found] == [("count", "reuse")]
    assert "predicts 0" in found[0].message


def test_the_judge_counts_blocks_past_the_last_state_as_their_sequences_own() -> None:
    """SGLang inserts a request's full KV only up to its last kept state (g = 8): A's 9
    tokens put 8 in the tree and keep their third block; B sharing A's first 4 tokens
    and computing 4 keeps no state, so its first block stays its own beside A's: 4 used
    blocks, not the 3 of a cache that dedups every computed block (vLLM's chunk-end
    rule, where the full-attention group caches every full block: a capacity finding)."""
    a, b = [4, 4, 6, 39, 33, 11, 23, 27, 4], [4, 4, 6, 39, 35, 18, 3, 19]

    def run(rule: str) -> list[Any]:
        j = Judge(_sglang_contract(rule), 16)
        got = j.observe(_report(ops.admit("A", a), {"reused_tokens": 0}, [
            {"kind": "admit", "seq_id": "A", "tokens": a, "num_tokens": 0, "scope": None,
             "block_ids": [1, 2, 3]},
            {"kind": "commit", "seq_id": "A", "num_tokens": 9}], 3, 0))
        got += j.observe(_report(ops.admit("B", b, None, 4), {"reused_tokens": 0}, [
            {"kind": "admit", "seq_id": "B", "tokens": b, "num_tokens": 0, "scope": None,
             "block_ids": [4]}], 4, 0))
        got += j.observe(_report(ops.commit("B", 4), None, [
            {"kind": "commit", "seq_id": "B", "num_tokens": 4}], 4, 0))
        return got

    assert run("extend-end") == []
    found = run("chunk-ends")
    assert [(v.oracle, v.kind) for v in found] == [("capacity", "used blocks")]
    assert "expected  3" in found[0].message
