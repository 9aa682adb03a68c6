"""Sequence: the live handle the manager returns for an admitted request (read-only)."""

from __future__ import annotations

from array import array
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvcache.core.radix import Node, ScopeKey
from kvcache.core.stats import RequestKvMetrics


class Holdings(NamedTuple):
    """How a sequence is tied to the tree (for integrity checks and failure messages).

    `last` ends the chain of tree nodes it references (None: it holds nothing cached);
    block positions [0, tree_blocks) are the blocks along that chain.
    """

    last: Node | None
    tree_blocks: int


class Sequence:
    """An admitted sequence. Every field is read-only; only the manager changes it.

    Block positions, by index into `block_ids`:

        [0, tree_blocks)            cached in the tree along the chain ending at `last`
        [tree_blocks, len)          private: reused partial block, fresh and decode blocks
    """

    __slots__ = ("_alloc_new", "_alloc_total", "_block_ids", "_block_ids_version", "_committed",
                 "_full_reused", "_last", "_missed", "_num_cached", "_partial_reused",
                 "_priority", "_scope", "_seq_id", "_tokens", "_tree_blocks")

    def __init__(self, seq_id: Hashable, tokens: array, scope: ScopeKey, priority: int,
                 block_ids: list[int], num_cached_tokens: int, last: Node | None,
                 tree_blocks: int) -> None:
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
        self._alloc_total = 0
        self._alloc_new = 0
        self._full_reused = 0
        self._partial_reused = 0
        self._missed = 0

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
    def block_ids(self) -> Seq[int]:
        """Physical block of each `tokens_per_block` tokens, in order (a live view: it
        grows as tokens are appended; do not mutate it)."""
        return self._block_ids

    @property
    def block_ids_version(self) -> int:
        """Bumped whenever a position already in `block_ids` changes block: a commit
        deduplicated against an equal cached block switches to that block and frees its
        own. A copy of the ids (an engine's block table) taken at another version is stale
        and must be re-read before the next forward pass. Appends do not bump it."""
        return self._block_ids_version

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
        return len(self._block_ids) - self._tree_blocks

    @property
    def holdings(self) -> Holdings:
        """Its ties to the tree, for integrity checks (a snapshot)."""
        return Holdings(self._last, self._tree_blocks)

    @property
    def metrics(self) -> RequestKvMetrics:
        """Per-request KV metrics (TensorRT-LLM's names)."""
        reused = self._full_reused + self._partial_reused
        return RequestKvMetrics(self._alloc_total, self._alloc_new, reused, self._missed,
                                self._full_reused, self._partial_reused, self._num_cached)

    def __repr__(self) -> str:
        return (f"Sequence({self._seq_id!r}, tokens={len(self._tokens)}, "
                f"cached={self._num_cached}, committed={self._committed}, "
                f"blocks={self._block_ids})")
