"""Operations the cache manager asks the engine to apply to KV storage.

Block ids name device blocks, slots name host blocks (their own id space,
0..host_cache_blocks-1). The engine reads the queue (`pending_copy_ops`), applies it
with `KvStorage.apply_copies`, in list order, before its next forward pass, and
acknowledges what was applied (`ack_copy_ops`): an op leaves the queue only once it ran.
List order is the manager's order of events, and it is what makes reuse safe: a device
block evicted and handed to a new owner is offloaded by an op queued before anything the
new owner does, and a host slot is read by an onboard queued before the slot is reused.
"""

from __future__ import annotations

from typing import NamedTuple


class BlockCopy(NamedTuple):
    """Copy the KV of the first `num_tokens` slots of device block `src` into device block
    `dst` (copy-on-partial-reuse)."""

    src: int
    dst: int
    num_tokens: int


class BlockOffload(NamedTuple):
    """Copy device block `src`, whole, into host slot `dst`: a full cached block evicted
    from the device pool moves to the host tier (a partial block is never offloaded)."""

    src: int
    dst: int


class BlockOnboard(NamedTuple):
    """Copy the first `num_tokens` slots of host slot `src` into device block `dst`: a
    reuse hit on the host tier (whole blocks), or a partial hit copied from a host block."""

    src: int
    dst: int
    num_tokens: int


KvOp = BlockCopy | BlockOffload | BlockOnboard


class CacheOwner:
    """The owner of a queued op that moves a cached block between tiers: the cache itself,
    not a sequence, so freeing a sequence never drops it."""

    def __repr__(self) -> str:
        return "CACHE"


CACHE = CacheOwner()  # the one instance
