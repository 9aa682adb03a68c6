"""CacheListener: what a caller that keeps something per cached block is told.

A caller may keep something beside a block's KV that must live and move with it (the
engine keeps a hybrid model's recurrent-state snapshot per block: they must leave with
their blocks, and follow them to the host tier and back). It adds itself with
`KvCacheManager.add_listener` and is told, after the fact and in the order they happen,
of every block the cache stops holding and of every move between the tiers (the moves
only with a host tier). The manager's own KV event log (kv_event_log.py) is told of the
same moves through the same methods, ahead of the listeners.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Protocol


class CacheListener(Protocol):
    """Told of what happens to cached blocks, after the fact. `tokens` are the moved
    blocks' token ids. A listener must not call back into the manager."""

    def removed(self, block_ids: list[int]) -> None:
        """Device blocks `block_ids` no longer hold what they held: evicted (or offloaded:
        `offloaded` said where to), claimed by an admission, given back by a commit that
        switched to equal cached blocks, or dropped by `reset_cache`."""

    def offloaded(self, block_ids: list[int], slots: list[int], tokens: array) -> None:
        """Device blocks `block_ids` now live in host `slots` (pairwise)."""

    def onboarded(self, slots: list[int], block_ids: list[int], tokens: array) -> None:
        """Host `slots` now live in device blocks `block_ids` (pairwise)."""

    def dropped(self, slots: Iterable[int]) -> None:
        """Host `slots` were dropped: their KV is gone."""

    def cleared(self) -> None:
        """Every cached block was dropped, in both tiers (`reset_cache`; `removed` then
        names the device blocks)."""
