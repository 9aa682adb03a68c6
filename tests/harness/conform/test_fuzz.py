"""The differential fuzz finds a planted scope bug, and shrinking cuts its op list down
to a few ops that still fail the same oracle and replay from JSON."""

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
    short = shrink(target, list(found.ops), found.num_blocks, oracle)
    assert len(short) <= 4 < len(found.ops)
    scopes = {op.scope.describe() for op in short if op.kind == "admit" and op.scope}
    assert f"salt={lora_id_text(1)!r}" in scopes and any("lora=" in s for s in scopes)
    again = ops_from_json(json.loads(json.dumps(ops_to_json(short))))
    assert oracle in [v.oracle for v in replay(target, again, found.num_blocks, B)]
    # the same ops on the real adapter are clean: the fault, not the ops, is the finding
    assert replay(LocalTarget(kvcache.load()), again, found.num_blocks, B) == []


def test_ddmin_keeps_exactly_what_the_failure_needs() -> None:
    items = [ops.evict(i) for i in range(20)]

    def fails(sub: list[ops.Op]) -> bool:
        kept = {op.num_blocks for op in sub}
        return {3, 11, 17} <= kept

    assert [op.num_blocks for op in _ddmin(items, fails)] == [3, 11, 17]
