"""KvCacheStats (cumulative) and per-request KV metrics, with TensorRT-LLM's names, and
the manager's running counters they are built from."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kvcache.core.pool import BlockPool

# snake_case field -> TensorRT-LLM's camelCase name
_CAMEL = {
    "max_num_blocks": "maxNumBlocks",
    "free_num_blocks": "freeNumBlocks",
    "used_num_blocks": "usedNumBlocks",
    "tokens_per_block": "tokensPerBlock",
    "alloc_total_blocks": "allocTotalBlocks",
    "alloc_new_blocks": "allocNewBlocks",
    "reused_blocks": "reusedBlocks",
    "missed_blocks": "missedBlocks",
    "full_reused_blocks": "fullReusedBlocks",
    "partial_reused_blocks": "partialReusedBlocks",
    "reused_tokens": "reusedTokens",
    "decode_alloc_blocks": "decodeAllocBlocks",
    "copied_blocks": "copiedBlocks",
    "claimed_blocks": "claimedBlocks",
    "evicted_blocks": "evictedBlocks",
    "cached_num_blocks": "cachedNumBlocks",
    "state_snapshot_bytes": "stateSnapshotBytes",
    "offloaded_blocks": "numOffloadedBlocks",
    "onboarded_blocks": "numOnboardedBlocks",
    "dropped_blocks": "numDroppedBlocks",
    "max_num_host_blocks": "maxNumHostBlocks",
    "cached_num_host_blocks": "cachedNumHostBlocks",
}
GAUGES = frozenset({"max_num_blocks", "free_num_blocks", "used_num_blocks", "tokens_per_block",
                    "cached_num_blocks", "state_snapshot_bytes", "max_num_host_blocks",
                    "cached_num_host_blocks"})


@dataclass(frozen=True)
class KvCacheStats:
    """A snapshot of the cache's counters.

    Gauges (max/free/used/cached blocks, tokens per block) are current values; the other
    fields count since start (`stats()`) or since the previous `step_stats()` call.
    A block no sequence references counts as free, cached or not. Missed blocks are the
    prompt blocks not reused (the one holding the last prompt token included); decode
    allocations are counted apart in `decode_alloc_blocks`. `alloc_total_blocks` counts
    every block handed to a request other than a reuse hit (copy targets included) and
    `alloc_new_blocks` those of them obtained without evicting cached content.
    `state_snapshot_bytes` is the memory of the recurrent-state snapshots a hybrid model's
    engine keeps with cached blocks (0 for the manager alone).

    With a host tier: `offloaded_blocks` of the evicted blocks moved to the host,
    `onboarded_blocks` came back from it (each also a reuse hit: full hits, and partial
    hits copied from a host block), `dropped_blocks` were evicted from the host (their
    KV is gone); `max_num_host_blocks` and `cached_num_host_blocks` are the host pool's
    size and occupancy (all 0 without a host tier).
    """

    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    full_reused_blocks: int = 0
    partial_reused_blocks: int = 0
    reused_tokens: int = 0
    decode_alloc_blocks: int = 0
    copied_blocks: int = 0
    claimed_blocks: int = 0
    evicted_blocks: int = 0
    cached_num_blocks: int = 0
    state_snapshot_bytes: int = 0
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    dropped_blocks: int = 0
    max_num_host_blocks: int = 0
    cached_num_host_blocks: int = 0

    @property
    def cache_hit_rate(self) -> float:
        """reused / (reused + missed); 0.0 when nothing was admitted."""
        total = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / total if total else 0.0

    def as_dict(self) -> dict[str, int | float]:
        """TensorRT-LLM's camelCase names, `cacheHitRate` included."""
        out: dict[str, int | float] = {_CAMEL[f.name]: getattr(self, f.name)
                                       for f in fields(self)}
        out["cacheHitRate"] = self.cache_hit_rate
        return out

    def minus(self, earlier: KvCacheStats) -> KvCacheStats:
        """Counters since `earlier`; gauges stay as in `self`."""
        values = {f.name: getattr(self, f.name) if f.name in GAUGES
                  else getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}
        return KvCacheStats(**values)


class RequestKvMetrics(NamedTuple):
    """Per-request KV metrics, named as TensorRT-LLM names them.

    With a host tier, `num_onboarded_blocks` of the reused blocks came from the host;
    `num_offloaded_blocks` and `num_dropped_blocks` count the offloads and host drops its
    own allocations (admission and decode) caused.
    """

    num_total_allocated_blocks: int
    num_new_allocated_blocks: int
    num_reused_blocks: int
    num_missed_blocks: int
    num_full_reused_blocks: int
    num_partial_reused_blocks: int
    num_reused_tokens: int
    num_onboarded_blocks: int = 0
    num_offloaded_blocks: int = 0
    num_dropped_blocks: int = 0

    @property
    def kv_cache_hit_rate(self) -> float:
        """reused / (reused + missed) for this request's prompt; 0.0 for none."""
        total = self.num_reused_blocks + self.num_missed_blocks
        return self.num_reused_blocks / total if total else 0.0

    def as_dict(self) -> dict[str, int | float]:
        """Field names plus kv_cache_hit_rate."""
        out: dict[str, int | float] = dict(self._asdict())
        out["kv_cache_hit_rate"] = self.kv_cache_hit_rate
        return out


class Counters:
    """The manager's cumulative counters, named as the `KvCacheStats` fields they become,
    kept as plain attributes for the hot path."""

    __slots__ = ("alloc_new_blocks", "alloc_total_blocks", "claimed_blocks", "copied_blocks",
                 "decode_alloc_blocks", "full_reused_blocks", "missed_blocks",
                 "partial_reused_blocks", "reused_tokens")

    def __init__(self) -> None:
        self.alloc_total_blocks = self.alloc_new_blocks = 0
        self.full_reused_blocks = self.partial_reused_blocks = self.missed_blocks = 0
        self.reused_tokens = self.decode_alloc_blocks = 0
        self.copied_blocks = self.claimed_blocks = 0


def cache_stats(counters: Counters, pool: BlockPool, private: int,
                tokens_per_block: int) -> KvCacheStats:
    """The statistics of a cache with `counters`, `pool` (and its host tier, if any)
    and `private` blocks that live sequences hold outside the tree; gauges are read now.
    Pure."""
    free = pool.num_available
    host = pool.host
    return KvCacheStats(
        max_num_blocks=pool.num_blocks, free_num_blocks=free,
        used_num_blocks=pool.num_blocks - free, tokens_per_block=tokens_per_block,
        alloc_total_blocks=counters.alloc_total_blocks,
        alloc_new_blocks=counters.alloc_new_blocks,
        reused_blocks=counters.full_reused_blocks + counters.partial_reused_blocks,
        missed_blocks=counters.missed_blocks, full_reused_blocks=counters.full_reused_blocks,
        partial_reused_blocks=counters.partial_reused_blocks,
        reused_tokens=counters.reused_tokens, decode_alloc_blocks=counters.decode_alloc_blocks,
        copied_blocks=counters.copied_blocks, claimed_blocks=counters.claimed_blocks,
        evicted_blocks=pool.num_evicted,
        cached_num_blocks=pool.num_blocks - pool.num_free - private,
        **({} if host is None else {
            "offloaded_blocks": host.num_offloaded, "onboarded_blocks": host.num_onboarded,
            "dropped_blocks": host.num_dropped, "max_num_host_blocks": host.num_slots,
            "cached_num_host_blocks": host.num_cached}))
