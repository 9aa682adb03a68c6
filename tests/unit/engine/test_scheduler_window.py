"""The scheduler under a sliding window: chunks reserve their blocks, a short pool shrinks
a chunk, and a step where no running request can get a block preempts one."""

from __future__ import annotations

import pytest

from kvcache import KvCacheConfig, KvCacheManager
from kvcache.attention import BlockTable, PersistentBatch
from kvcache.engine.request import Request
from kvcache.engine.scheduler import Scheduler
from kvcache.engine.step_records import Chunk, Sampled, Schedule


def _setup(pool: int, budget: int = 8) -> tuple[KvCacheManager, Scheduler]:
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=pool,
                                       sliding_window=8))
    table = BlockTable(2, pool)
    return mgr, Scheduler(mgr, table, PersistentBatch(table, block_size=4),
                          max_num_tokens=budget, max_batch_size=2, chunked=True)


def _compute(sched: Scheduler, step: Schedule) -> None:
    """What the engine does around a forward: the step's metadata from the batch, then
    the scheduler's postprocess, here of the chunks alone (nothing sampled, so the
    request stays running): count, commit and sync the table (and the batch's rows)."""
    sched.batch.step(step.row_tokens)
    sched.postprocess([Chunk(c.req, c.num_new, False) for c in step.chunks],
                      Sampled([], None))


def test_chunks_reserve_their_blocks_and_the_table_follows_the_window() -> None:
    mgr, sched = _setup(pool=5)
    req = Request(0, list(range(1, 41)), 1, None, 35, None, False)
    sched.waiting.append(req)
    for _ in range(5):
        step = sched.schedule()
        assert [c.num_new for c in step.chunks] == [8]
        _compute(sched, step)
        assert req.seq is not None and req.slot is not None
        first = req.seq.num_released_blocks
        assert int(sched.table.starts[req.slot]) == first
        assert sched.table.block_ids(req.slot) == req.seq.live_block_ids()
        mgr.check_integrity()
    assert req.num_computed == 40 and mgr.stats().evicted_blocks > 0
    sched.release(req)


def test_a_short_pool_shrinks_the_chunk_and_a_stuck_step_preempts() -> None:
    mgr, sched = _setup(pool=4)
    mgr.add_sequence("other", list(range(50, 58)))  # holds two of the four blocks
    req = Request(0, list(range(1, 41)), 1, None, 35, None, False)
    sched.waiting.append(req)
    _compute(sched, sched.schedule())  # admitted with the two blocks left
    assert req.num_computed == 8
    assert sched.schedule().chunks == []  # no block for its next chunk, and nobody else runs
    assert (req.num_preemptions, req.seq, list(sched.waiting)) == (1, None, [req])
    mgr.check_integrity()
    assert sched.schedule().chunks == []  # waits: the other sequence still holds its blocks
    mgr.free_sequence("other")
    step = sched.schedule()
    assert req.num_cached_tokens == 0 and req.num_computed == 8  # its 8 tokens were cached
    assert [c.num_new for c in step.chunks] == [8]
    _compute(sched, step)
    sched.release(req)
    mgr.check_integrity()


class Interrupt(BaseException):
    """Like KeyboardInterrupt: not an Exception."""


def test_a_stuck_step_whose_preemption_raises_preempts_nothing() -> None:
    """The windowed scheduler's preemption, interrupted at its phase point (the engine's
    fault seam): the request keeps running with its blocks and rows, and the next
    schedule preempts it as the first would have."""
    mgr, sched = _setup(pool=4)
    mgr.add_sequence("other", list(range(50, 58)))
    req = Request(0, list(range(1, 41)), 1, None, 35, None, False)
    sched.waiting.append(req)
    _compute(sched, sched.schedule())
    blocks = list(req.seq.block_ids) if req.seq else None

    def fault(phase: str) -> None:
        if phase == "preempt":
            raise Interrupt(phase)

    sched.step_fault = fault
    with pytest.raises(Interrupt):
        sched.schedule()
    assert sched.running == [req] and req.num_preemptions == 0
    assert req.seq is not None and list(req.seq.block_ids) == blocks
    assert req.slot is not None and sched.table.block_ids(req.slot) == blocks
    mgr.check_integrity()
    sched.step_fault = None
    assert sched.schedule().chunks == []
    assert (req.num_preemptions, req.seq, list(sched.waiting)) == (1, None, [req])
    mgr.check_integrity()
