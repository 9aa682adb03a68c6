"""vLLM's scheduler adapter appends under a chunk budget below the appended tokens: the
append takes the steps vLLM needs to schedule them all (here the last one preempts the
sequence, whose next block does not fit), never one step that leaves tokens without KV
while the op reports them appended. The shrunk fuzz case (seed 382 of 400 on 0.33.0)
runs on the cached install, skipped where it is not cached, as the engine smoke is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.conform import ops
from harness.conform.controller.judge import Judge
from harness.conform.controller.locks import pinned
from harness.conform.controller.targets import Target
from harness.conform.protocol import CacheOptions
from tests.harness.conform.cached_engines import open_cached

LOCK = next(lock for lock in pinned() if lock.spec == "vllm==0.33.0")


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Target]:
    with open_cached(LOCK, tmp_path) as opened:
        yield opened


def test_an_append_past_the_chunk_budget_is_scheduled_whole_or_preempted(
        target: Target) -> None:
    contract = target.open(2, 4, CacheOptions(chunk_budget=2, long_prefill_threshold=6))
    judge = Judge(contract, 2)
    reports = target.apply_all([
        ops.admit("s4", [1, 2, 3]), ops.reserve("s4", 3), ops.append("s4", [4]),
        ops.append("s4", [5, 6]), ops.append("s4", [7, 8, 9])])
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    # 9 tokens need a third block of 4 and the pool has 2: vLLM preempts the sequence
    last = reports[-1]
    assert last.preempted == ("s4",) and last.used_blocks == 0
    assert [e["kind"] for e in last.log] == ["append", "free"]
