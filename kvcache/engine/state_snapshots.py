"""Recurrent-state snapshots kept with cached blocks, so hybrid models can reuse prefixes.

A recurrent (SSM-like) layer's state summarises every token so far and cannot be rolled
back, so KV blocks alone cannot resume a hybrid model mid-prompt. The engine keeps, for
every committed full block that ends at a multiple of `interval` blocks, each recurrent
layer's state after the block's last token. The cache manager aligns every match to
those blocks (`KvCacheConfig.reuse_alignment_blocks`), and a warm request starts from the
snapshot of the last block it reuses.

A snapshot lives with its block: taken before the block is committed (so it exists
whenever the block can be matched), dropped when the block leaves the tree (the manager's
`on_blocks_removed`). Memory: one [recurrent layers, hidden] float32 tensor per cached
block at a snapshot position, about 1/interval of the cached blocks
(`nbytes`; the stats report it as `stateSnapshotBytes`).

    block:      |  b0  |  b1  |  b2  |  b3  |      interval = 2
    snapshot:           ^ s(b1)       ^ s(b3)     state after the block's last token
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvcache.engine.scheduler import Chunk


class StateSnapshots:
    """Snapshots by physical block id. Mutated by the engine only."""

    def __init__(self, recurrent_layers: Sequence[int], hidden: int, interval: int) -> None:
        self.layers = tuple(recurrent_layers)
        self.hidden = hidden
        self.interval = interval
        self._by_block: dict[int, torch.Tensor] = {}  # block id -> [layers, hidden]
        self._bytes_each = 4 * len(self.layers) * hidden

    def positions(self, start: int, end: int, block_size: int) -> range:
        """Token counts in (start, end] at which a snapshot is due: ends of every
        `interval`-th block."""
        step = block_size * self.interval
        first = (start // step + 1) * step
        return range(first, end + 1, step)

    def restore(self, chunks: Sequence[Chunk], block_size: int) -> None:
        """A request of this step admitted warm resumes its recurrent state from the
        snapshot of the last block it reuses (the manager aligns reuse to snapshots).
        Mutates the requests' `state`."""
        for c in chunks:
            req = c.req
            if req.num_computed and not req.state and req.seq is not None:
                req.state = self.load(req.seq.block_id(req.num_computed // block_size - 1))

    def rows(self, chunks: Sequence[Chunk], block_size: int) -> dict[int, int]:
        """Block id -> the token row of this step whose recurrent state is its snapshot:
        the last token of every snapshot block a chunk completes."""
        rows: dict[int, int] = {}
        offset = 0
        for c in chunks:
            req = c.req
            assert req.seq is not None
            start = req.num_computed
            for end in self.positions(start, start + c.num_new, block_size):
                rows[req.seq.block_id(end // block_size - 1)] = offset + end - start - 1
            offset += c.num_new
        return rows

    def save(self, block_id: int, states: Sequence[torch.Tensor]) -> None:
        """Keep `states` (one [hidden] tensor per recurrent layer, in layer order) as the
        snapshot of `block_id`, replacing any older one."""
        self._by_block[block_id] = torch.stack([s.detach().float() for s in states])

    def load(self, block_id: int) -> dict[int, torch.Tensor]:
        """The snapshot of `block_id` as {layer: [hidden]} (copies). KeyError if absent:
        the manager only matches blocks whose snapshot was taken."""
        snap = self._by_block[block_id]
        return {layer: snap[i].clone() for i, layer in enumerate(self.layers)}

    def drop(self, block_ids: Iterable[int]) -> None:
        """Forget the snapshots of blocks that left the cache."""
        for block in block_ids:
            self._by_block.pop(block, None)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._by_block

    @property
    def nbytes(self) -> int:
        """Bytes the kept snapshots occupy."""
        return len(self._by_block) * self._bytes_each
