"""CacheState: everything a KvCacheManager keeps, as one plain object the manager owns.

The manager (manager.py) checks each call, then does the work on its state, itself or
with the functions beside it, each taking the state as its first argument: admission.py
(a prompt's plan, and carrying it out), caching.py (committed blocks and tails into the
tree), growth.py (blocks after admission), window_holds.py (what a sliding window
holds and releases); stats.py and integrity.py read it. Every field is public so that
those functions, and a reader, can follow it; only the manager's checked calls change
it, so a call that fails its checks changes nothing.

It is also how a caller reads the cache: `manager.state` is the one way to its
configuration (`config`, and the effective `reuse`), its tree, its pools (`pool`, and
`host` behind it) and its event log (`events`). Callers read these and never change
them, but for the fault-injection seam `allocation_fault`, the one field a test sets.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvcache.core.config import KvCacheConfig
from kvcache.core.events import CacheEvent
from kvcache.core.handle import SequenceHandle, SequenceRecord
from kvcache.core.host_tier import HostTier
from kvcache.core.kv_event_log import KvEventLog
from kvcache.core.listener import CacheListener
from kvcache.core.ops import KvOp
from kvcache.core.pool import Allocation, BlockPool
from kvcache.core.radix import BlockRadixTree
from kvcache.core.stats import Counters


def _out_of_memory(config: KvCacheConfig, field: str) -> ValueError:
    return ValueError(f"KvCacheManager: out of memory building the free list of "
                      f"KvCacheConfig.{field}={getattr(config, field)} blocks; lower it")


class CacheState:
    """A paged KV cache's bookkeeping: a block radix tree over a fixed block pool (and a
    host tier behind it), the live sequences' records and handles, the queued ops, the
    counters and the event logs. Raises ValueError for a `config` that is not a
    KvCacheConfig, or one whose pools' free lists do not fit in memory (naming the
    field)."""

    __slots__ = ("alignment_blocks", "allocation_fault", "config", "copy_on_partial",
                 "counters", "events", "handles", "host", "kv_event_log", "listeners",
                 "op_queue", "partial_reuse", "pool", "records", "reuse", "tokens_per_block",
                 "tree", "version", "window_left")

    def __init__(self, config: KvCacheConfig, *, record_events: bool = False,
                 kv_events: bool = False) -> None:
        if not isinstance(config, KvCacheConfig):
            raise ValueError(f"KvCacheManager: expected a KvCacheConfig, got {config!r}")
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        # the token at position p sees keys p - window_left .. p (None: full attention)
        self.window_left = None if config.sliding_window is None else config.sliding_window - 1
        self.tree = BlockRadixTree(self.tokens_per_block)
        try:  # the free lists hold one Python int a block: a pool may not fit in memory
            self.pool = BlockPool(config.max_num_blocks, self.tree,
                                  windowed=self.window_left is not None)
        except MemoryError:
            raise _out_of_memory(config, "max_num_blocks") from None
        # KV-cache events for routers (blocks stored and removed), see kv_events.py
        self.kv_event_log = KvEventLog(self.tokens_per_block) if kv_events else None
        # the host tier (TensorRT-LLM's secondary pool; never with a window), host_tier.py
        self.host: HostTier | None = None
        if config.host_cache_blocks:
            try:
                self.host = self.pool.host = HostTier(
                    config.host_cache_blocks, self.pool, self.queue,
                    [self.kv_event_log] if self.kv_event_log is not None else [])
            except MemoryError:
                raise _out_of_memory(config, "host_cache_blocks") from None
        self.reuse = config.block_reuse
        self.partial_reuse = config.partial_reuse
        self.copy_on_partial = config.copy_on_partial
        self.alignment_blocks = config.reuse_alignment_blocks
        # the live sequences, by seq_id: their records, and the handles callers get (the
        # same keys always: admission adds to both, free_sequence takes from both)
        self.records: dict[Hashable, SequenceRecord] = {}
        self.handles: dict[Hashable, SequenceHandle] = {}
        # (owner, op): a sequence's copies die with it; CACHE's moves of tree blocks never
        self.op_queue: list[tuple[Hashable, KvOp]] = []
        self.counters = Counters()
        self.version = 0  # bumped by every mutation: plans made before it are stale
        self.events: list[CacheEvent] | None = [] if record_events else None
        # The callers' listeners (listener.py; `KvCacheManager.add_listener`), told after
        # the KV event log of blocks removed and moved; with a host tier also in its list.
        self.listeners: list[CacheListener] = []
        # Test seam for fault injection, the one field a caller sets: called as
        # (operation, blocks needed) before any allocation; returning True refuses it (a
        # plan that does not fit, or OutOfBlocksError from append_tokens), nothing changed.
        self.allocation_fault: Callable[[str, int], bool] | None = None

    def queue(self, owner: Hashable, op: KvOp) -> None:
        """Queue `op` for the engine to apply (`pending_copy_ops`); it is dropped with
        `owner` (CACHE: never)."""
        self.op_queue.append((owner, op))

    def removed(self, block_ids: list[int]) -> None:
        """Report cached blocks that left the tree (the KV event log, then the listeners)."""
        if self.kv_event_log is not None:
            self.kv_event_log.removed(block_ids)
        for listener in self.listeners:
            listener.removed(block_ids)

    def allocate(self, num_blocks: int) -> Allocation:
        """Take `num_blocks` blocks from the pool (the caller checked they are there):
        free ones first, then evicted ones, reported as removed. Mutates the pool and
        the tree, and with a host tier the host, which the evictions offload to."""
        host = self.host
        if host is None:  # nothing is offloaded or dropped: no counts to take
            allocation = self.pool.allocate(num_blocks)
            if allocation.num_fresh < num_blocks:
                self.removed(allocation.block_ids[allocation.num_fresh:])
            return allocation
        offloaded, dropped = host.num_offloaded, host.num_dropped
        allocation = self.pool.allocate(num_blocks)
        if allocation.num_fresh < num_blocks:
            self.removed(allocation.block_ids[allocation.num_fresh:])
        return allocation._replace(num_offloaded=host.num_offloaded - offloaded,
                                   num_dropped=host.num_dropped - dropped)
