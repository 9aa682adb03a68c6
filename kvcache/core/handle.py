"""Sequence: the live handle the manager returns for an admitted request (read-only)."""

from __future__ import annotations

from array import array
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from typing import NamedTuple, cast

from kvcache.core.keys import ScopeKey
from kvcache.core.radix import Node
from kvcache.core.stats import RequestKvMetrics


class Holdings(NamedTuple):
    """How a sequence is tied to the tree (for integrity checks and failure messages).

    `last` ends the chain of tree nodes it references (None: it holds nothing cached);
    block positions [0, tree_blocks) are the blocks along that chain. Positions before
    `first` are released (sliding window): it references the chain from the node
    holding position `first` down to `last` only.
    """

    last: Node | None
    tree_blocks: int
    first: int = 0


class Sequence:
    """An admitted sequence. Every field is read-only; only the manager changes it.

    Block positions, by index into `block_ids`:

        [0, first)                  released (sliding window): None, held by nobody
                                    for this sequence (cached blocks stay in the tree)
        [first, tree_blocks)        cached in the tree along the chain ending at `last`
        [tree_blocks, len)          private: reused partial block, fresh and decode blocks

    Under full attention `first` is 0 and the blocks cover every token; under a sliding
    window they may cover only the tokens the engine asked for so far (`reserve`).
    """

    __slots__ = ("_alloc_new", "_alloc_total", "_block_ids", "_block_ids_version", "_committed",
                 "_dropped", "_first", "_full_reused", "_last", "_missed", "_num_cached",
                 "_offloaded", "_onboarded", "_partial_reused", "_priority", "_scope",
                 "_seq_id", "_tokens", "_tree_blocks")

    def __init__(self, seq_id: Hashable, tokens: array, scope: ScopeKey, priority: int,
                 block_ids: list[int | None], num_cached_tokens: int, last: Node | None,
                 tree_blocks: int, first: int = 0) -> None:
        self._seq_id = seq_id
        self._tokens = tokens
        self._scope = scope
        self._priority = priority
        self._block_ids = block_ids
        self._num_cached = num_cached_tokens
        self._committed = num_cached_tokens
        self._last = last
        self._tree_blocks = tree_blocks
        self._block_ids_version = 0
        self._first = first
        self._alloc_total = 0
        self._alloc_new = 0
        self._full_reused = 0
        self._partial_reused = 0
        self._missed = 0
        self._onboarded = self._offloaded = self._dropped = 0  # host tier

    @property
    def seq_id(self) -> Hashable:
        """The id it was admitted under."""
        return self._seq_id

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens reused at admission (any alignment; never the last one)."""
        return self._num_cached

    @property
    def num_committed_tokens(self) -> int:
        """Tokens whose KV is valid (reused or committed)."""
        return self._committed

    @property
    def block_ids(self) -> Seq[int | None]:
        """Physical block of each `tokens_per_block` tokens, in order, None where released
        (a live view: it grows as tokens are appended; do not mutate it)."""
        return self._block_ids

    @property
    def block_ids_version(self) -> int:
        """Bumped whenever a position already in `block_ids` changes block: a commit
        deduplicated against an equal cached block switches to that block and frees its
        own. A copy of the ids (an engine's block table) taken at another version is stale
        and must be re-read before the next forward pass. Appends do not bump it."""
        return self._block_ids_version

    @property
    def num_released_blocks(self) -> int:
        """Leading block positions released because no later token's window reaches them
        (always 0 under full attention)."""
        return self._first

    def block_id(self, position: int) -> int:
        """The id of block `position`; ValueError if the window released it."""
        block = self._block_ids[position]
        if block is None:
            raise ValueError(f"sequence {self._seq_id!r}: block {position} was released "
                             f"(the first {self._first} are)")
        return block

    def live_block_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """The ids of block positions [max(start, num_released_blocks), end), in order
        (end None: to the last block)."""
        return cast(list[int], self._block_ids[max(start, self._first):end])

    @property
    def tokens(self) -> Seq[int]:
        """Prompt plus appended tokens (a live view; do not mutate it)."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus appended tokens."""
        return len(self._tokens)

    @property
    def scope(self) -> ScopeKey:
        """The key of its reuse scope (None for the default scope)."""
        return self._scope

    @property
    def priority(self) -> int:
        """Its retention priority."""
        return self._priority

    @property
    def num_private_blocks(self) -> int:
        """Blocks this sequence owns outside the tree (returned to the pool on free)."""
        return len(self._block_ids) - max(self._tree_blocks, self._first)

    @property
    def holdings(self) -> Holdings:
        """Its ties to the tree, for integrity checks (a snapshot)."""
        return Holdings(self._last, self._tree_blocks, self._first)

    @property
    def metrics(self) -> RequestKvMetrics:
        """Per-request KV metrics (TensorRT-LLM's names)."""
        reused = self._full_reused + self._partial_reused
        return RequestKvMetrics(self._alloc_total, self._alloc_new, reused, self._missed,
                                self._full_reused, self._partial_reused, self._num_cached,
                                self._onboarded, self._offloaded, self._dropped)

    def __repr__(self) -> str:
        return (f"Sequence({self._seq_id!r}, tokens={len(self._tokens)}, "
                f"cached={self._num_cached}, committed={self._committed}, "
                f"blocks={self._block_ids})")
