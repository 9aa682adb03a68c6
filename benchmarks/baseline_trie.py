"""The in-repository baseline: a deliberately plain per-block dict trie.

One dict lookup per block, keyed by the block's token tuple, with none of the run-length
edges, byte comparisons or incremental accounting of `kvcache`. Cache-core benchmarks
report their throughput as a ratio to this, measured in the same run; it mirrors the
workload's operations (admit with the L-1 cap, take the copies an engine applies before
its forward pass (none here), commit full blocks, free, and a bare lookup) and nothing more.
"""

from __future__ import annotations


class _Node:
    __slots__ = ("block", "children")

    def __init__(self, block: int) -> None:
        self.block = block
        self.children: dict[tuple[int, ...], _Node] = {}


class PlainTrie:
    """Full-block prefix reuse with a per-block walk; no eviction, partial reuse or scopes."""

    def __init__(self, tokens_per_block: int, num_blocks: int) -> None:
        self.B = tokens_per_block
        self.root = _Node(-1)
        self.free = list(range(num_blocks))
        # seq_id -> (tokens, block ids, duplicate block ids, committed full blocks)
        self.seqs: dict[int, tuple[list[int], list[int], list[int], int]] = {}

    def match(self, tokens: list[int]) -> list[int]:
        """The cached blocks of the full blocks of tokens[:L-1] (a lookup; no changes)."""
        B = self.B
        node = self.root
        blocks: list[int] = []
        for i in range((len(tokens) - 1) // B):
            child = node.children.get(tuple(tokens[i * B:(i + 1) * B]))
            if child is None:
                break
            blocks.append(child.block)
            node = child
        return blocks

    def add_sequence(self, seq_id: int, tokens: list[int]) -> int:
        """Match full blocks of tokens[:L-1], allocate the rest; returns reused tokens."""
        B = self.B
        blocks = self.match(tokens)
        reused = len(blocks)
        blocks += [self.free.pop() for _ in range(-(-len(tokens) // B) - reused)]
        self.seqs[seq_id] = (list(tokens), blocks, [], reused)
        return reused * B

    def take_copy_ops(self) -> list[object]:
        """No partial reuse, so no copies: what the manager's queue would hold, empty."""
        return []

    def commit(self, seq_id: int, num_tokens: int) -> None:
        """Insert the sequence's full blocks; a duplicate keeps the cached block."""
        tokens, blocks, dups, _ = self.seqs[seq_id]
        B = self.B
        node = self.root
        for i in range(num_tokens // B):
            key = tuple(tokens[i * B:(i + 1) * B])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(blocks[i])
            elif child.block != blocks[i] and blocks[i] not in dups:
                dups.append(blocks[i])
            node = child
        self.seqs[seq_id] = (tokens, blocks, dups, num_tokens // B)

    def free_sequence(self, seq_id: int) -> None:
        """Return the blocks the trie does not hold."""
        _, blocks, dups, committed = self.seqs.pop(seq_id)
        self.free += dups
        self.free += blocks[committed:]
