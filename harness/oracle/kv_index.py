"""An event-only index of what one replica caches, as a cache-aware router keeps it.

It folds the replica's KV-cache events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`,
as objects or as the dicts of their JSON lines) into a multiset of cached blocks keyed by
medium and hash ("GPU" for the device pool, "CPU" for the host tier: a block offloaded
to the host is removed from one and stored on the other), and predicts how many prompt
tokens the replica would reuse (a block on either medium is a hit). It imports nothing
from `kvcache`: the block hash is re-derived here from its published definition (the
first 8 bytes of BLAKE2b over the parent's hash or a root tag, the block's tokens as
little-endian uint32, and the repr of the scope key), as a router in another process or
language would.

`probe` is exact for a replica whose partial matches never depend on who holds a block:
partial reuse off, or copy-on-partial-reuse on (any cached child may then be copied), and
a pool that is not so full that the replica forgoes a partial hit to protect its copy
source. It applies the same caps as the cache: never the last prompt token, whole blocks
first, then at most one partial block.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

_ROOT = b"kvcache-harness/root"


def block_hash(parent: int | None, tokens: Sequence[int], scope: Hashable) -> int:
    """The published chained block hash (see the module docstring)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_ROOT if parent is None else parent.to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    h.update(repr(scope).encode())
    return int.from_bytes(h.digest(), "little")


def scope_key(salt: Any = None, lora_id: Any = None) -> Hashable:
    """The cache's scope key for a salt and LoRA id (None for the default scope)."""
    return None if salt is None and lora_id is None else (salt, lora_id)


class CachedBlock(NamedTuple):
    """One cached block as the events describe it."""

    parent: int | None
    tokens: tuple[int, ...]
    scope: Hashable
    medium: str


def _field(event: Any, name: str) -> Any:
    return event[name] if isinstance(event, Mapping) else getattr(event, name)


Key = tuple[str, int]  # (medium, hash)


class EventIndex:
    """Cached blocks of one replica, rebuilt from its events alone. Mutates only itself."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[Key, CachedBlock] = {}
        self.counts: Counter[Key] = Counter()  # a hash stored twice must be removed twice
        self._present: Counter[int] = Counter()  # hash -> media holding it
        self._tokens: dict[int, tuple[int, ...]] = {}  # hash -> its tokens, on any medium
        self._parent: dict[int, int | None] = {}  # hash -> its parent's, on any medium
        self._children: dict[tuple[int | None, Hashable], Counter[int]] = {}
        self.num_events = 0

    def apply(self, event: Any) -> None:
        """Fold one event (an event object or its dict). ValueError for an unknown type,
        a wrong block size or the removal of a block that is not cached."""
        kind = _field(event, "type")
        self.num_events += 1
        if kind == "BlockStored":
            self._stored(event)
        elif kind == "BlockRemoved":
            medium = _field(event, "medium")
            for h in _field(event, "block_hashes"):
                self._remove((medium, h))
        elif kind == "AllBlocksCleared":
            self.blocks.clear()
            self.counts.clear()
            self._present.clear()
            self._tokens.clear()
            self._parent.clear()
            self._children.clear()
        else:
            raise ValueError(f"EventIndex: unknown event type {kind!r}")

    def extend(self, events: Iterable[Any]) -> None:
        """Fold events in order."""
        for event in events:
            self.apply(event)

    def _stored(self, event: Any) -> None:
        if _field(event, "block_size") != self.block_size:
            raise ValueError(f"EventIndex: event block_size {_field(event, 'block_size')} "
                             f"!= {self.block_size}")
        hashes = list(_field(event, "block_hashes"))
        tokens = list(_field(event, "token_ids"))
        salt = _field(event, "salt")
        if isinstance(salt, Mapping):  # a bytes salt in JSON lines: {"hex": ...}
            salt = bytes.fromhex(salt["hex"])
        scope = scope_key(salt, _field(event, "lora_id"))
        medium = _field(event, "medium")
        parent = _field(event, "parent_block_hash")
        B = self.block_size
        for i, h in enumerate(hashes):
            block = CachedBlock(parent, tuple(tokens[i * B:(i + 1) * B]), scope, medium)
            key = (medium, h)
            if self.counts[key] and self.blocks[key] != block:
                raise ValueError(f"EventIndex: hash {h} stored for two different blocks")
            if not self.counts[key]:
                self.blocks[key] = block
                self._tokens[h] = block.tokens
                self._parent[h] = parent
                self._present[h] += 1
                self._children.setdefault((parent, scope), Counter())[h] += 1
            self.counts[key] += 1
            parent = h

    def _remove(self, key: Key) -> None:
        if not self.counts[key]:
            del self.counts[key]
            raise ValueError(f"EventIndex: BlockRemoved names hash {key[1]}, which is not "
                             f"cached on {key[0]}")
        self.counts[key] -= 1
        if self.counts[key]:
            return
        del self.counts[key]
        h = key[1]
        block = self.blocks.pop(key)
        self._present[h] -= 1
        if not self._present[h]:
            del self._present[h]
            del self._tokens[h]
            del self._parent[h]
        siblings = self._children[(block.parent, block.scope)]
        siblings[h] -= 1
        if not siblings[h]:
            del siblings[h]
        if not siblings:
            del self._children[(block.parent, block.scope)]

    def chain_tokens(self, block_hash: Any) -> tuple[int, ...] | None:
        """The tokens from the root to the end of the cached block `block_hash`, read up
        its chain of parents (on any medium): what a block stored under it follows.
        None when it, or a block above it, is not cached, or the chain loops (a hash
        that does not chain its parent can name its own ancestor). Changes nothing."""
        parts: list[tuple[int, ...]] = []
        seen: set[Any] = set()
        h: Any = block_hash
        while h is not None:
            if h in seen or h not in self._tokens:
                return None
            seen.add(h)
            parts.append(self._tokens[h])
            h = self._parent[h]
        return tuple(t for part in reversed(parts) for t in part)

    def cached(self, medium: str | None = None) -> Counter[int]:
        """The multiset of cached block hashes on `medium` ("GPU", "CPU"), or on all."""
        out: Counter[int] = Counter()
        for (m, h), n in self.counts.items():
            if medium is None or m == medium:
                out[h] += n
        return out

    def probe(self, tokens: Sequence[int], salt: Any = None, lora_id: Any = None, *,
              partial_reuse: bool = True) -> int:
        """Prompt tokens the replica would reuse for `tokens` (see the module docstring)."""
        scope = scope_key(salt, lora_id)
        B = self.block_size
        limit = len(tokens) - 1
        parent: int | None = None
        n = 0
        while n + B <= limit:
            h = block_hash(parent, tokens[n:n + B], scope)
            if h not in self._present:
                break
            parent, n = h, n + B
        if not partial_reuse or n >= limit:
            return n
        rest = tokens[n:min(limit, n + B)]
        best = 0
        for h in self._children.get((parent, scope), ()):
            have = self._tokens[h]
            k = 0
            while k < len(rest) and k < len(have) and have[k] == rest[k]:
                k += 1
            best = max(best, k)
        return n + best
