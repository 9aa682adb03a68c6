"""KvEventLog: the manager's recorder of KV-cache events (see `kv_events`).

The manager calls it where blocks enter or leave its tree; it keeps what the events need
and the tree does not: each live sequence's chain of block hashes (computed once per
block, when a block of that sequence is first stored) and, for every cached device block
id and host slot, the block's hash, its parent's hash and its scope (so an eviction can
name what it removed, and a block moving between tiers can be stored again on the other
medium). It is only built with `kv_events=True`, so a manager without events pays one
`is None` test per hook.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable

from kvcache.core.keys import ScopeKey
from kvcache.core.kv_events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    Medium,
    block_hash,
    little_endian_bytes,
)

# what the log keeps per cached block: its hash, its parent's hash and its scope
_Cached = tuple[int, int | None, ScopeKey]


class KvEventLog:
    """Pending events, plus the hashes they are computed from. Mutated only by the manager."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[KvCacheEvent] = []
        self._chains: dict[Hashable, list[int]] = {}  # seq_id -> hashes of its full blocks
        self._device: dict[int, _Cached] = {}  # cached device block id -> what it holds
        self._host: dict[int, _Cached] = {}  # host slot -> what it holds

    def _chain(self, seq_id: Hashable, tokens: array, scope: ScopeKey, nblocks: int) -> list[int]:
        chain = self._chains.setdefault(seq_id, [])
        size = self.block_size
        for i in range(len(chain), nblocks):
            chain.append(block_hash(chain[-1] if chain else None,
                                    little_endian_bytes(tokens[i * size:(i + 1) * size]), scope))
        return chain

    def stored(self, seq_id: Hashable, tokens: array, scope: ScopeKey, start: int,
               block_ids: list[int]) -> None:
        """Full blocks start.. of sequence `seq_id` entered the tree as `block_ids`."""
        end = start + len(block_ids)
        chain = self._chain(seq_id, tokens, scope, end)
        hashes = tuple(chain[start:end])
        parents = (chain[start - 1] if start else None, *hashes[:-1])
        self._device.update(zip(block_ids, zip(hashes, parents, (scope,) * len(hashes),
                                               strict=True), strict=True))
        size = self.block_size
        self.pending.append(self._stored(hashes, parents[0], tokens[start * size:end * size],
                                         scope, MEDIUM_DEVICE))

    def stored_partial(self, seq_id: Hashable, tokens: array, scope: ScopeKey, start: int,
                       num_tokens: int, block_id: int) -> None:
        """The partial block `start` (its first `num_tokens` tokens) entered the tree."""
        chain = self._chain(seq_id, tokens, scope, start)
        parent = chain[start - 1] if start else None
        size = self.block_size
        part = tokens[start * size:start * size + num_tokens]
        hashed = block_hash(parent, little_endian_bytes(part), scope)
        self._device[block_id] = (hashed, parent, scope)
        self.pending.append(self._stored((hashed,), parent, part, scope, MEDIUM_DEVICE))

    def _stored(self, hashes: tuple[int, ...], parent: int | None, tokens: array,
                scope: ScopeKey, medium: Medium) -> BlockStored:
        salt, lora = scope if isinstance(scope, tuple) else (None, None)
        return BlockStored(hashes, parent, tuple(tokens), self.block_size, salt, lora, medium)

    def removed(self, block_ids: Iterable[int]) -> None:
        """Cached device blocks left the device pool (evicted, offloaded, or claimed by a
        sequence)."""
        hashes = tuple(self._device.pop(b)[0] for b in block_ids)
        if hashes:
            self.pending.append(BlockRemoved(hashes, MEDIUM_DEVICE))

    def offloaded(self, block_ids: list[int], slots: list[int], tokens: array) -> None:
        """Cached device blocks `block_ids` (token ids `tokens`) were copied to host
        `slots`: stored on the host. Their removal from the device is `removed`, which
        the eviction that offloaded them reports."""
        cached = [self._device[b] for b in block_ids]
        self._host.update(zip(slots, cached, strict=True))
        self._store_moved(cached, tokens, MEDIUM_HOST)

    def onboarded(self, slots: list[int], block_ids: list[int], tokens: array) -> None:
        """Host `slots` (token ids `tokens`) moved back to device blocks `block_ids`:
        removed from the host, stored on the device."""
        cached = [self._host.pop(s) for s in slots]
        self.pending.append(BlockRemoved(tuple(block[0] for block in cached), MEDIUM_HOST))
        self._device.update(zip(block_ids, cached, strict=True))
        self._store_moved(cached, tokens, MEDIUM_DEVICE)

    def _store_moved(self, cached: list[_Cached], tokens: array, medium: Medium) -> None:
        _, parent, scope = cached[0]
        self.pending.append(self._stored(tuple(block[0] for block in cached), parent, tokens, scope,
                                         medium))

    def dropped(self, slots: Iterable[int]) -> None:
        """Host slots were dropped from the host tier (their KV is gone)."""
        hashes = tuple(self._host.pop(s)[0] for s in slots)
        if hashes:
            self.pending.append(BlockRemoved(hashes, MEDIUM_HOST))

    def freed(self, seq_id: Hashable) -> None:
        """Sequence `seq_id` ended: forget its chain."""
        self._chains.pop(seq_id, None)

    def cleared(self) -> None:
        """Every cached block was dropped (both tiers)."""
        self._device.clear()
        self._host.clear()
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KvCacheEvent]:
        """The pending events, oldest first; the log is emptied."""
        out, self.pending = self.pending, []
        return out
