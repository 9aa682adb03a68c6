"""A live sequence: the manager's record of it, and the read-only handle callers get.

`SequenceRecord` is what the manager keeps for each admitted sequence. Its fields are
public and only kvcache/core changes them, through the manager's checked calls:
admission (admission.py) creates the record, `commit` (caching.py, window_holds.py),
`reserve` and `append_tokens` (growth.py) change it, `free_sequence` drops it.
`SequenceHandle` is what `admit` and `add_sequence` return and `sequences` holds: a view of one
record whose every field is read-only, and always current. The record does not point
back at its handle, so a freed sequence's objects go when their last user lets go.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import NamedTuple, cast

from kvcache.core.keys import ScopeKey
from kvcache.core.pool import Allocation
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


class SequenceRecord:
    """The manager's record of an admitted sequence; only kvcache/core changes it.

    Block positions, by index into `block_ids`:

        [0, num_released_blocks)    released (sliding window): None, held by nobody
                                    for this sequence (cached blocks stay in the tree)
        [.., num_tree_blocks)       cached in the tree along the chain ending at
                                    `last_node`
        [num_tree_blocks, len)      private: reused partial block, fresh and decode blocks

    Under full attention `num_released_blocks` is 0 and the blocks cover every token;
    under a sliding window they may cover only the tokens reserved so far (`reserve`).
    `block_ids_version` is bumped whenever a position already in `block_ids` changes
    block (a commit deduplicated against an equal cached block). The `num_*_blocks`
    counts after those are its `RequestKvMetrics`.
    """

    __slots__ = ("block_ids", "block_ids_version", "last_node", "num_cached_tokens",
                 "num_committed_tokens", "num_dropped_blocks", "num_full_reused_blocks",
                 "num_missed_blocks", "num_new_allocated_blocks", "num_offloaded_blocks",
                 "num_onboarded_blocks", "num_partial_reused_blocks", "num_released_blocks",
                 "num_total_allocated_blocks", "num_tree_blocks", "priority", "scope", "seq_id",
                 "tokens")

    def __init__(self, seq_id: Hashable, tokens: array, scope: ScopeKey, priority: int,
                 block_ids: list[int | None], num_cached_tokens: int, last_node: Node | None,
                 num_tree_blocks: int, num_released_blocks: int) -> None:
        self.seq_id = seq_id
        self.tokens = tokens  # prompt plus appended tokens
        self.scope = scope
        self.priority = priority
        self.block_ids = block_ids
        self.num_cached_tokens = num_cached_tokens  # reused at admission
        self.num_committed_tokens = num_cached_tokens
        self.last_node = last_node
        self.num_tree_blocks = num_tree_blocks
        self.num_released_blocks = num_released_blocks
        self.block_ids_version = 0
        self.num_total_allocated_blocks = self.num_new_allocated_blocks = 0
        self.num_full_reused_blocks = self.num_partial_reused_blocks = 0
        self.num_missed_blocks = 0
        self.num_onboarded_blocks = self.num_offloaded_blocks = self.num_dropped_blocks = 0

    def live_block_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """The ids of block positions [max(start, num_released_blocks), end), in order
        (end None: to the last block). A new list."""
        return cast(list[int], self.block_ids[max(start, self.num_released_blocks):end])

    def num_private_blocks(self) -> int:
        """Blocks it owns outside the tree (returned to the pool when it is freed)."""
        return len(self.block_ids) - max(self.num_tree_blocks, self.num_released_blocks)

    def add_blocks(self, allocation: Allocation) -> None:
        """Append the blocks of `allocation` (after the admission: reserved or decode
        blocks) and count them in its metrics."""
        self.block_ids += allocation.block_ids
        self.num_total_allocated_blocks += len(allocation.block_ids)
        self.num_new_allocated_blocks += allocation.num_fresh
        self.num_offloaded_blocks += allocation.num_offloaded
        self.num_dropped_blocks += allocation.num_dropped


class SequenceHandle:
    """An admitted sequence, as callers see it. Every field is read-only and current:
    it reads the manager's record, which only the manager changes.

    Block positions, by index into `block_ids`:

        [0, first)                  released (sliding window): None, held by nobody
                                    for this sequence (cached blocks stay in the tree)
        [first, tree_blocks)        cached in the tree along the chain ending at `last`
        [tree_blocks, len)          private: reused partial block, fresh and decode blocks

    (`first`, `tree_blocks` and `last` are `holdings`.) Under full attention `first` is 0
    and the blocks cover every token; under a sliding window they may cover only the
    tokens the engine asked for so far (`reserve`). The handle stays readable after the
    sequence is freed, frozen as it was then.
    """

    __slots__ = ("_record",)

    def __init__(self, record: SequenceRecord) -> None:
        self._record = record

    @property
    def seq_id(self) -> Hashable:
        """The id it was admitted under."""
        return self._record.seq_id

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens reused at admission (any alignment; never the last one)."""
        return self._record.num_cached_tokens

    @property
    def num_committed_tokens(self) -> int:
        """Tokens whose KV is valid (reused or committed)."""
        return self._record.num_committed_tokens

    @property
    def block_ids(self) -> Sequence[int | None]:
        """Physical block of each `tokens_per_block` tokens, in order, None where released
        (a live view: it grows as tokens are appended; do not mutate it)."""
        return self._record.block_ids

    @property
    def block_ids_version(self) -> int:
        """Bumped whenever a position already in `block_ids` changes block: a commit
        deduplicated against an equal cached block switches to that block and frees its
        own. A copy of the ids (an engine's block table) taken at another version is stale
        and must be re-read before the next forward pass. Appends do not bump it."""
        return self._record.block_ids_version

    @property
    def num_released_blocks(self) -> int:
        """Leading block positions released because no later token's window reaches them
        (always 0 under full attention)."""
        return self._record.num_released_blocks

    def block_id(self, position: int) -> int:
        """The id of block `position`; ValueError if the window released it."""
        record = self._record
        block = record.block_ids[position]
        if block is None:
            raise ValueError(f"sequence {record.seq_id!r}: block {position} was released "
                             f"(the first {record.num_released_blocks} are)")
        return block

    def live_block_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """The ids of block positions [max(start, num_released_blocks), end), in order
        (end None: to the last block)."""
        return self._record.live_block_ids(start, end)

    @property
    def tokens(self) -> Sequence[int]:
        """Prompt plus appended tokens (a live view; do not mutate it)."""
        return self._record.tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus appended tokens."""
        return len(self._record.tokens)

    @property
    def scope(self) -> ScopeKey:
        """The key of its reuse scope (None for the default scope)."""
        return self._record.scope

    @property
    def priority(self) -> int:
        """Its retention priority."""
        return self._record.priority

    @property
    def num_private_blocks(self) -> int:
        """Blocks this sequence owns outside the tree (returned to the pool on free)."""
        return self._record.num_private_blocks()

    @property
    def holdings(self) -> Holdings:
        """Its ties to the tree, for integrity checks (a snapshot)."""
        record = self._record
        return Holdings(record.last_node, record.num_tree_blocks, record.num_released_blocks)

    @property
    def metrics(self) -> RequestKvMetrics:
        """Per-request KV metrics (TensorRT-LLM's names)."""
        record = self._record
        full, partial = record.num_full_reused_blocks, record.num_partial_reused_blocks
        return RequestKvMetrics(
            num_total_allocated_blocks=record.num_total_allocated_blocks,
            num_new_allocated_blocks=record.num_new_allocated_blocks,
            num_reused_blocks=full + partial, num_missed_blocks=record.num_missed_blocks,
            num_full_reused_blocks=full, num_partial_reused_blocks=partial,
            num_reused_tokens=record.num_cached_tokens,
            num_onboarded_blocks=record.num_onboarded_blocks,
            num_offloaded_blocks=record.num_offloaded_blocks,
            num_dropped_blocks=record.num_dropped_blocks)

    def __repr__(self) -> str:
        record = self._record
        return (f"SequenceHandle({record.seq_id!r}, tokens={len(record.tokens)}, "
                f"cached={record.num_cached_tokens}, committed={record.num_committed_tokens}, "
                f"blocks={record.block_ids})")
