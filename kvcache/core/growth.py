"""Blocks for a sequence's tokens after its admission: reserved prompt chunks, decode.

Under a sliding window an admission allocates only its first chunk's blocks and
`KvCacheManager.reserve` asks for the rest chunk by chunk (`reserve_blocks`, as many as
the pool can give); `append_tokens` asks for the blocks of generated tokens
(`append_blocks`, all or nothing). Both take free blocks first, then evict
(`CacheState.allocate`), and count the allocation. Only the manager calls these, after
checking the call; each takes its `CacheState` explicitly.
"""

from __future__ import annotations

from kvcache.core.events import CacheEvent
from kvcache.core.handle import SequenceRecord
from kvcache.core.pool import OutOfBlocksError
from kvcache.core.state import CacheState


def reserve_blocks(state: CacheState, record: SequenceRecord, need: int) -> None:
    """Allocate up to `need` (> 0) more blocks for `record`: as many as the pool can
    give, none when the fault-injection seam refuses. Never raises for lack of room."""
    fault = state.allocation_fault
    take = 0 if fault is not None and fault("reserve", need) else min(
        need, state.pool.num_available)
    if not take:
        return
    state.version += 1
    allocation = state.allocate(take)
    record.add_blocks(allocation)
    counters = state.counters
    counters.alloc_total_blocks += take
    counters.alloc_new_blocks += allocation.num_fresh
    if state.events is not None:  # an append of no tokens: blocks ahead
        state.events.append(CacheEvent("append", record.seq_id, (), 0, None,
                                       tuple(allocation.block_ids)))


def append_blocks(state: CacheState, record: SequenceRecord, need: int) -> None:
    """Allocate `need` (> 0) more blocks for tokens appended to `record`; raises
    OutOfBlocksError, changing nothing, when they cannot be had."""
    pool = state.pool
    fault = state.allocation_fault
    if fault is not None and fault("append_tokens", need):
        raise OutOfBlocksError(f"append_tokens({record.seq_id!r}) [injected fault]", need, 0,
                               pool.num_blocks)
    if need > pool.num_available:
        raise OutOfBlocksError(f"append_tokens({record.seq_id!r})", need, pool.num_available,
                               pool.num_blocks)
    state.version += 1
    allocation = state.allocate(need)
    record.add_blocks(allocation)
    counters = state.counters
    counters.decode_alloc_blocks += need
    counters.alloc_total_blocks += need
    counters.alloc_new_blocks += allocation.num_fresh
