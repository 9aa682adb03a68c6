"""KvEventLog: the manager's recorder of KV-cache events (see `kv_events`).

The manager calls it where blocks enter or leave its tree; it keeps what the events need
and the tree does not: each live sequence's chain of block hashes (computed once per
block, when a block of that sequence is first stored) and the hash of every cached block
id (so an eviction can name what it removed). It is only built with `kv_events=True`, so
a manager without events pays one `is None` test per hook.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Hashable, Iterable

from kvcache.core.kv_events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    block_hash,
)
from kvcache.core.radix import ScopeKey

_LITTLE = sys.byteorder == "little"


def _le(tokens: array) -> bytes:
    if _LITTLE:
        return tokens.tobytes()
    swapped = array("I", tokens)
    swapped.byteswap()
    return swapped.tobytes()


class KvEventLog:
    """Pending events, plus the hashes they are computed from. Mutated only by the manager."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[KvCacheEvent] = []
        self._chains: dict[Hashable, list[int]] = {}  # seq_id -> hashes of its full blocks
        self._hash_of: dict[int, int] = {}  # cached block id -> its hash

    def _chain(self, seq_id: Hashable, tokens: array, scope: ScopeKey, nblocks: int) -> list[int]:
        chain = self._chains.setdefault(seq_id, [])
        B = self.block_size
        for i in range(len(chain), nblocks):
            chain.append(block_hash(chain[-1] if chain else None,
                                    _le(tokens[i * B:(i + 1) * B]), scope))
        return chain

    def stored(self, seq_id: Hashable, tokens: array, scope: ScopeKey, start: int,
               block_ids: list[int]) -> None:
        """Full blocks start.. of sequence `seq_id` entered the tree as `block_ids`."""
        end = start + len(block_ids)
        chain = self._chain(seq_id, tokens, scope, end)
        hashes = tuple(chain[start:end])
        self._hash_of.update(zip(block_ids, hashes, strict=True))
        B = self.block_size
        self.pending.append(self._stored(hashes, chain[start - 1] if start else None,
                                         tokens[start * B:end * B], scope))

    def stored_partial(self, seq_id: Hashable, tokens: array, scope: ScopeKey, start: int,
                       num_tokens: int, block_id: int) -> None:
        """The partial block `start` (its first `num_tokens` tokens) entered the tree."""
        chain = self._chain(seq_id, tokens, scope, start)
        parent = chain[start - 1] if start else None
        B = self.block_size
        part = tokens[start * B:start * B + num_tokens]
        h = block_hash(parent, _le(part), scope)
        self._hash_of[block_id] = h
        self.pending.append(self._stored((h,), parent, part, scope))

    def _stored(self, hashes: tuple[int, ...], parent: int | None, tokens: array,
                scope: ScopeKey) -> BlockStored:
        salt, lora = scope if isinstance(scope, tuple) else (None, None)
        return BlockStored(hashes, parent, tuple(tokens), self.block_size, salt, lora,
                           MEDIUM_DEVICE)

    def removed(self, block_ids: Iterable[int]) -> None:
        """Cached blocks left the tree (evicted, or claimed by a sequence)."""
        hashes = tuple(self._hash_of.pop(b) for b in block_ids)
        if hashes:
            self.pending.append(BlockRemoved(hashes, MEDIUM_DEVICE))

    def freed(self, seq_id: Hashable) -> None:
        """Sequence `seq_id` ended: forget its chain."""
        self._chains.pop(seq_id, None)

    def cleared(self) -> None:
        """Every cached block was dropped."""
        self._hash_of.clear()
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KvCacheEvent]:
        """The pending events, oldest first; the log is emptied."""
        out, self.pending = self.pending, []
        return out
