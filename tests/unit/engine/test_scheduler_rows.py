"""The scheduler's rows mirror the cache handles between steps: after every step each
running request's block-table row lists exactly its handle's live blocks from its first
kept position, and its batch row counts exactly its computed tokens. Three workloads
make the handles change under the rows: deduplicated commits (blocks switched in
place), a sliding window (blocks released at the front) and a short pool (preemption)."""

from __future__ import annotations

import random

import pytest

from kvcache import Engine, EngineConfig, KvCacheConfig
from kvcache.engine.scheduler import Scheduler


def check_rows(engine: Engine) -> tuple[bool, bool]:
    """Assert every running request's rows equal its handle; returns whether some handle
    had its blocks switched (a deduplicated commit) and whether some released blocks."""
    scheduler: Scheduler = engine.scheduler
    switched = released = False
    for req in scheduler.running:
        seq, slot = req.seq, req.slot
        assert seq is not None and slot is not None
        assert engine.table.block_ids(slot) == seq.live_block_ids(), f"request {req.request_id}"
        assert int(engine.table.starts[slot]) == seq.num_released_blocks
        assert engine.batch.kv_len(slot) == req.num_computed
        switched = switched or seq.block_ids_version > 0
        released = released or seq.num_released_blocks > 0
    assert engine.batch.slots == [r.slot for r in scheduler.running]
    return switched, released


@pytest.mark.parametrize(("preset", "blocks", "expect"), [
    pytest.param("tiny", 64, "switched", id="dedupe"),
    pytest.param("tiny-swa", 64, "released", id="window"),
    pytest.param("tiny", 14, "preempted", id="preempt"),
])
def test_rows_mirror_the_handles_between_steps(preset: str, blocks: int, expect: str) -> None:
    rng = random.Random(7)
    shared = [rng.randrange(1, 500) for _ in range(12)]
    # share_prefixes off: siblings admitted together compute the prefix twice, and the
    # later commit is deduplicated against the earlier one's blocks
    engine = Engine(preset, KvCacheConfig(tokens_per_block=4, max_num_blocks=blocks),
                    EngineConfig(max_num_tokens=24, max_batch_size=4, share_prefixes=False))
    length = 40 if preset == "tiny-swa" else 6
    for i in range(6):
        engine.add_request(shared + [rng.randrange(1, 500) for _ in range(length)] + [i], 16)
    seen = {"switched": False, "released": False, "preempted": False}
    while engine.has_unfinished():
        outs = engine.step()
        seen["preempted"] |= any(o.num_preemptions for o in outs)
        switched, released = check_rows(engine)
        seen["switched"] |= switched
        seen["released"] |= released
    assert seen[expect], f"the workload never {expect} a request's blocks: {seen}"
    engine.manager.check_integrity()
