"""CacheState: what a KVCacheManager keeps, and the two ways its work reports back.

The manager's work is split by concept across classes over this state: `Admission`
(admission.py: the plan's walk and carrying it out), `Caching` (caching.py: committed
blocks and tails into the tree), `Growth` (growth.py: blocks after admission).
`KVCacheManager` (manager.py) combines them and is the only class callers use: it checks
every call before any of them changes the state. The attributes without an underscore
are the manager's public ones.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvcache.core.config import KvCacheConfig
from kvcache.core.events import CacheEvent
from kvcache.core.handle import Sequence
from kvcache.core.host_tier import HostTier
from kvcache.core.kv_event_log import KvEventLog
from kvcache.core.ops import KvOp
from kvcache.core.pool import BlockPool
from kvcache.core.radix import BlockRadixTree
from kvcache.core.stats import Counters, KvCacheStats


def _out_of_memory(config: KvCacheConfig, field: str) -> ValueError:
    return ValueError(f"KVCacheManager: out of memory building the free list of "
                      f"KvCacheConfig.{field}={getattr(config, field)} blocks; lower it")


class CacheState:
    """A paged KV cache's bookkeeping state: a block radix tree over a fixed block pool,
    the live sequences, queued ops, counters and event logs. Raises ValueError for a
    `config` that is not a KvCacheConfig, or one whose pools' free lists do not fit in
    memory (naming the field)."""

    def __init__(self, config: KvCacheConfig, *, record_events: bool = False,
                 kv_events: bool = False) -> None:
        if not isinstance(config, KvCacheConfig):
            raise ValueError(f"KVCacheManager: expected a KvCacheConfig, got {config!r}")
        self.config = config
        self._B = config.tokens_per_block
        # window_left of the sliding window the cache exploits (None: full attention)
        self._wl = None if config.sliding_window is None else config.sliding_window - 1
        self.tree = BlockRadixTree(self._B)
        try:  # the free lists hold one Python int a block: a pool may not fit in memory
            self.pool = BlockPool(config.max_num_blocks, self.tree,
                                  windowed=self._wl is not None)
        except MemoryError:
            raise _out_of_memory(config, "max_num_blocks") from None
        # KV-cache events for routers (blocks stored and removed), see kv_events.py
        self._kv = KvEventLog(self._B) if kv_events else None
        # the host tier (TensorRT-LLM's secondary pool; never with a window), host_tier.py
        self._host: HostTier | None = None
        if config.host_cache_blocks:
            try:
                self._host = self.pool.host = HostTier(
                    config.host_cache_blocks, self.pool, self._queue,
                    [self._kv] if self._kv is not None else [])
            except MemoryError:
                raise _out_of_memory(config, "host_cache_blocks") from None
        self.reuse = config.block_reuse
        self._partial = config.partial_reuse
        self._copy = config.copy_on_partial
        self._align = config.reuse_alignment_blocks
        self.sequences: dict[Hashable, Sequence] = {}
        # (owner, op): a sequence's copies die with it; CACHE's moves of tree blocks never
        self._copy_ops: list[tuple[Hashable, KvOp]] = []
        self._c = Counters()
        self._step_base: KvCacheStats | None = None
        self._version = 0  # bumped by every mutation: plans made before it are stale
        self.events: list[CacheEvent] | None = [] if record_events else None
        # Told the ids of cached blocks that left the tree (evicted, or claimed by an
        # admission), and of a sequence's own blocks given back when its commit switched
        # to equal cached ones, after the fact: the engine drops what it keeps per block.
        self.on_blocks_removed: Callable[[list[int]], None] | None = None
        # Test seam for fault injection: called as (operation, blocks needed) before any
        # allocation; returning True refuses it (a plan that does not fit, or
        # OutOfBlocksError from append_tokens), nothing changed.
        self.allocation_fault: Callable[[str, int], bool] | None = None

    def _queue(self, owner: Hashable, op: KvOp) -> None:
        """Queue `op` for the engine to apply (`pending_copy_ops`); it is dropped with
        `owner` (CACHE: never)."""
        self._copy_ops.append((owner, op))

    def _removed(self, block_ids: list[int]) -> None:
        """Report cached blocks that left the tree (KV events, on_blocks_removed)."""
        if self._kv is not None:
            self._kv.removed(block_ids)
        if self.on_blocks_removed is not None:
            self.on_blocks_removed(block_ids)
