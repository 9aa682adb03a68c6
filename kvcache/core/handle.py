"""Sequence: the live handle the manager returns for an admitted request."""

from __future__ import annotations

from array import array
from collections.abc import Hashable

from kvcache.core.radix import Node, ScopeKey
from kvcache.core.stats import RequestKvMetrics


class Sequence:
    """An admitted sequence. Read its fields; change it only through the manager.

    Block positions, by index into `block_ids`:

        [0, tree_blocks)            cached in the tree along the chain ending at `last`
                                    (ids listed in `shadow` are the sequence's private
                                    duplicates of blocks someone else committed first)
        [tree_blocks, len)          private: reused partial block, fresh and decode blocks
    """

    __slots__ = ("alloc_new", "alloc_total", "block_ids", "full_reused", "last", "missed",
                 "num_cached_tokens", "num_committed_tokens", "partial_reused", "priority",
                 "scope", "seq_id", "shadow", "tokens", "tree_blocks")

    def __init__(self, seq_id: Hashable, tokens: array, scope: ScopeKey, priority: int,
                 block_ids: list[int], num_cached_tokens: int, last: Node | None,
                 tree_blocks: int) -> None:
        self.seq_id = seq_id
        self.tokens = tokens
        self.scope = scope
        self.priority = priority
        self.block_ids = block_ids
        self.num_cached_tokens = num_cached_tokens
        self.num_committed_tokens = num_cached_tokens
        self.last = last
        self.tree_blocks = tree_blocks
        self.shadow: list[int] = []
        self.alloc_total = 0
        self.alloc_new = 0
        self.full_reused = 0
        self.partial_reused = 0
        self.missed = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus appended tokens."""
        return len(self.tokens)

    @property
    def num_private_blocks(self) -> int:
        """Blocks this sequence owns outside the tree (returned to the pool on free)."""
        return len(self.block_ids) - self.tree_blocks + len(self.shadow)

    @property
    def metrics(self) -> RequestKvMetrics:
        """Per-request KV metrics (TensorRT-LLM's names)."""
        reused = self.full_reused + self.partial_reused
        return RequestKvMetrics(self.alloc_total, self.alloc_new, reused, self.missed,
                                self.full_reused, self.partial_reused, self.num_cached_tokens)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, tokens={len(self.tokens)}, "
                f"cached={self.num_cached_tokens}, committed={self.num_committed_tokens}, "
                f"blocks={self.block_ids})")
