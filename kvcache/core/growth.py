"""Blocks for a sequence's tokens after its admission: reserved prompt chunks, decode.

Under a sliding window an admission allocates only its first chunk's blocks and
`KVCacheManager.reserve` asks for the rest chunk by chunk (`_reserve_blocks`, as many as
the pool can give); `append_tokens` asks for the blocks of generated tokens
(`_append_blocks`, all or nothing). Both take free blocks first, then evict, and count
the allocation. A base class of KVCacheManager over its state (state.py).
"""

from __future__ import annotations

from kvcache.core.events import CacheEvent
from kvcache.core.handle import Sequence
from kvcache.core.pool import OutOfBlocksError
from kvcache.core.state import CacheState


class Growth(CacheState):
    """The growth side of the manager: blocks after admission."""

    def _reserve_blocks(self, seq: Sequence, need: int) -> None:
        """Allocate up to `need` (> 0) more blocks for `seq`: as many as the pool can give,
        none when the fault-injection seam refuses. Never raises for lack of room."""
        pool = self.pool
        fault = self.allocation_fault
        take = 0 if fault is not None and fault("reserve", need) else min(need, pool.num_available)
        if not take:
            return
        self._version += 1
        new, fresh = pool.allocate(take)
        if fresh < take:
            self._removed(new[fresh:])
        seq._block_ids += new
        seq._alloc_total += take
        seq._alloc_new += fresh
        self._c.alloc_total += take
        self._c.alloc_new += fresh
        if self.events is not None:  # an append of no tokens: blocks ahead
            self.events.append(CacheEvent("append", seq._seq_id, (), 0, None, tuple(new)))


    def _append_blocks(self, seq: Sequence, need: int) -> None:
        """Allocate `need` (> 0) more blocks for tokens appended to `seq`; raises
        OutOfBlocksError, changing nothing, when they cannot be had."""
        pool = self.pool
        if self.allocation_fault is not None and self.allocation_fault("append_tokens", need):
            raise OutOfBlocksError(f"append_tokens({seq._seq_id!r}) [injected fault]", need, 0,
                                   pool.num_blocks)
        if need > pool.num_available:
            raise OutOfBlocksError(f"append_tokens({seq._seq_id!r})", need, pool.num_available,
                                   pool.num_blocks)
        self._version += 1
        host = self._host
        moved = (host.num_offloaded, host.num_dropped) if host is not None else (0, 0)
        new, fresh = pool.allocate(need)
        if fresh < need:
            self._removed(new[fresh:])
        if host is not None:
            seq._offloaded += host.num_offloaded - moved[0]
            seq._dropped += host.num_dropped - moved[1]
        seq._block_ids += new
        seq._alloc_total += need
        seq._alloc_new += fresh
        c = self._c
        c.decode_alloc += need
        c.alloc_total += need
        c.alloc_new += fresh
