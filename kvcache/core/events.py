"""The order in which the cache saw admissions, commits, appends, frees and block moves.

Recorded when `KvCacheManager(record_events=True)`. An independent oracle replays it to
predict reuse under any batching or chunking (the tokens and counts) and, given the pool
sizes, eviction (the admissions' retention priorities); the harness's
provenance oracle replays it to follow which tokens' KV each physical block holds (the
block ids).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Literal, NamedTuple

from kvcache.core.ops import CACHE, BlockCopy, BlockOffload, KvOp

EventKind = Literal["admit", "commit", "append", "free", "copy", "offload", "onboard"]


class CacheEvent(NamedTuple):
    """One cache operation, by kind:

    - admit: `tokens` the prompt, `scope`, `num_tokens` the tokens reused, `block_ids`
      every block of the sequence (under a sliding window: None for positions its match
      skipped, and only the blocks of its first chunk), `priority` its retention
      priority (None on every other kind);
    - commit: `num_tokens` the tokens whose KV is now valid; `block_ids` the sequence's
      blocks when a deduplicated commit switched some of them to equal cached blocks,
      else empty;
    - append: `tokens` the new tokens, `block_ids` the blocks allocated for them (no
      tokens: blocks reserved for tokens it already has, under a sliding window);
    - free: nothing more;
    - copy: a `BlockCopy` the engine applied before its next forward pass (logged when
      acknowledged: `ack_copy_ops`, `take_copy_ops`): `block_ids` (src, dst),
      `num_tokens` the slots copied; `seq_id` the sequence whose admission queued it;
    - offload, onboard: a `BlockOffload` (device block src to host slot dst, all
      `num_tokens` = tokens_per_block slots) or `BlockOnboard` (host slot src's first
      `num_tokens` slots to device block dst) applied likewise; `seq_id` is "CACHE" for
      a move of a cached block, the sequence for a partial hit copied from the host.
    """

    kind: EventKind
    seq_id: Hashable
    tokens: tuple[int, ...] = ()
    num_tokens: int = 0
    scope: Hashable | None = None
    block_ids: tuple[int | None, ...] = ()  # None: released by a sliding window
    priority: int | None = None  # an admission's retention priority

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly form; an admit also has its "priority"."""
        out: dict[str, Any] = {"kind": self.kind, "seq_id": self.seq_id,
                               "tokens": list(self.tokens), "num_tokens": self.num_tokens,
                               "scope": self.scope, "block_ids": list(self.block_ids)}
        if self.priority is not None:
            out["priority"] = self.priority
        return out


def op_event(owner: Hashable, op: KvOp, tokens_per_block: int) -> CacheEvent:
    """The log's record of `op` (queued for `owner`), applied by the engine."""
    who = "CACHE" if owner is CACHE else owner
    if isinstance(op, BlockOffload):
        return CacheEvent("offload", who, (), tokens_per_block, None, (op.src, op.dst))
    kind: EventKind = "copy" if isinstance(op, BlockCopy) else "onboard"
    return CacheEvent(kind, who, (), op.num_tokens, None, (op.src, op.dst))
