"""The differential fuzz finds a planted scope bug, and shrinking cuts its op list down
to a few ops that still fail the same way (the first violation's oracle and kind, at an
op of the same kind), on a smaller pool with renamed tokens, and replay from JSON."""

from __future__ import annotations

import json

from harness.conform import ops
from harness.conform.adapters import kvcache
from harness.conform.controller.families import B
from harness.conform.controller.fuzz import _ddmin, fuzz, shrink
from harness.conform.controller.targets import LocalTarget, replay
from harness.conform.ops import ops_from_json, ops_to_json
from harness.conform.protocol import lora_id_text
from tests.harness.conform import faults


def test_a_seed_draws_the_same_ops_every_time() -> None:
    target = LocalTarget(kvcache.load())
    first, again = fuzz(target, 5), fuzz(target, 5)
    assert first.ops == again.ops and first.violation is None
    kinds = {op.kind for op in first.ops}
    assert kinds >= {"admit", "commit", "free", "append"}


def test_the_fuzz_finds_and_shrinks_a_salt_that_reads_a_loras_kv() -> None:
    target = LocalTarget(kvcache.load(faults.SaltIsLora))
    found = next(o for o in (fuzz(target, s) for s in range(40)) if o.violation is not None)
    assert found.violation is not None
    oracle = found.violation.oracle
    short = shrink(target, list(found.ops), found.num_blocks, found.violation)
    assert len(short.ops) <= 4 < len(found.ops)
    scopes = {op.scope.describe() for op in short.ops if op.kind == "admit" and op.scope}
    assert f"salt={lora_id_text(1)!r}" in scopes and any("lora=" in s for s in scopes)
    again = ops_from_json(json.loads(json.dumps(ops_to_json(short.ops))))
    assert oracle in [v.oracle for v in replay(target, again, short.num_blocks, B)]
    # the same ops on the real adapter are clean: the fault, not the ops, is the finding
    assert replay(LocalTarget(kvcache.load()), again, short.num_blocks, B) == []


def _failure(target: LocalTarget, op_list: list[ops.Op], num_blocks: int
             ) -> tuple[str, str, str]:
    """(oracle, kind, op kind) of the first violation `op_list` shows."""
    first = replay(target, op_list, num_blocks, B)[0]
    return first.oracle, first.kind, op_list[first.step].kind


def test_shrinking_keeps_the_first_violation_not_another_of_its_oracle() -> None:
    target = LocalTarget(kvcache.load(faults.RefusesEarlyLeaksWhenAlone))
    op_list = [ops.admit("A", range(100, 108)), ops.admit("B", range(200, 204)), ops.free("B"),
               ops.admit("C", range(300, 308)), ops.admit("D", range(400, 404))]
    first = replay(target, op_list, 8, B)[0]
    assert (first.oracle, first.kind, first.step) == ("capacity", "unfair refusal", 4)
    # without A, B's free leaks: a capacity violation too, but another failure, which a
    # shrinker holding to the oracle alone took (it did, on this list)
    assert _failure(target, op_list[1:], 8) == ("capacity", "used blocks", "free")
    short = shrink(target, op_list, 8, first)
    assert _failure(target, short.ops, short.num_blocks) == ("capacity", "unfair refusal",
                                                             "admit")
    assert len(short.ops) < len(op_list) and short.num_blocks < 8


def test_a_fuzz_failure_shrinks_its_ops_its_pool_and_its_tokens() -> None:
    target = LocalTarget(kvcache.load(faults.RefusesEarly))
    found = next(o for o in (fuzz(target, s) for s in range(40)) if o.violation is not None)
    assert found.violation is not None
    failure = _failure(target, list(found.ops), found.num_blocks)
    short = shrink(target, list(found.ops), found.num_blocks, found.violation)
    assert _failure(target, short.ops, short.num_blocks) == failure
    assert len(short.ops) < len(found.ops) and short.num_blocks < found.num_blocks
    tokens = {t for op in short.ops for t in op.tokens}
    assert tokens == set(range(1, len(tokens) + 1))  # renamed in order of first use
    assert sum(len(op.tokens) for op in short.ops) < sum(len(op.tokens) for op in found.ops)


def test_ddmin_keeps_exactly_what_the_failure_needs() -> None:
    items = [ops.evict(i) for i in range(20)]

    def fails(sub: list[ops.Op]) -> bool:
        kept = {op.num_blocks for op in sub}
        return {3, 11, 17} <= kept

    assert [op.num_blocks for op in _ddmin(items, fails)] == [3, 11, 17]

