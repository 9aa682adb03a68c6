"""Recurrent-state snapshots kept with cached blocks, so hybrid models can reuse prefixes.

A recurrent (SSM-like) layer's state summarises every token so far and cannot be rolled
back, so KV blocks alone cannot resume a hybrid model mid-prompt. The engine keeps, for
every committed full block that ends at a multiple of `interval` blocks, each recurrent
layer's state after the block's last token. The cache manager aligns every match to
those blocks (`KvCacheConfig.reuse_alignment_blocks`), and a warm request starts from the
snapshot of the last block it reuses.

A snapshot lives with its block: taken by the step that computes the block's last token,
saved once that step happened and before the block is committed (so it exists whenever
the block can be matched; a step that raised saved none). It is the manager's listener
(kvcache/core/listener.py): a snapshot is dropped when its block leaves the tree
(`removed`, `cleared`) and, with a host tier, follows its block there and back
(`offloaded`, `onboarded`, `dropped`), kept by host slot meanwhile; the tensor itself
stays where it was (a few hundred bytes a block, against kilobytes of KV).
Memory: one [recurrent layers, hidden] float32 tensor per cached block at a snapshot
position, about 1/interval of the cached blocks (`nbytes`; the stats report it as
`stateSnapshotBytes`).

    block:      |  b0  |  b1  |  b2  |  b3  |      interval = 2
    snapshot:           ^ s(b1)       ^ s(b3)     state after the block's last token
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import torch

from kvcache.engine.step_records import Chunk


class StateSnapshots:
    """Snapshots by physical block id (and by host slot while a block is offloaded).
    Mutated by the engine and, as its listener, by the cache manager."""

    def __init__(self, recurrent_layers: Sequence[int], hidden: int, interval: int) -> None:
        self.layers = tuple(recurrent_layers)
        self.hidden = hidden
        self.interval = interval
        self._by_block: dict[int, torch.Tensor] = {}  # block id -> [layers, hidden]
        self._by_slot: dict[int, torch.Tensor] = {}  # host slot -> the same, offloaded
        self._bytes_each = 4 * len(self.layers) * hidden

    def positions(self, start: int, end: int, block_size: int) -> range:
        """Token counts in (start, end] at which a snapshot is due: ends of every
        `interval`-th block."""
        step = block_size * self.interval
        first = (start // step + 1) * step
        return range(first, end + 1, step)

    def start_states(self, chunks: Sequence[Chunk],
                     block_size: int) -> list[dict[int, torch.Tensor]]:
        """Each chunk's request's recurrent state at the step's start ({layer: [hidden]}):
        its own, or for a request admitted warm (tokens reused, no state yet) the
        snapshot of the last block it reuses (the manager aligns reuse to snapshots).
        Changes nothing: the request takes a state only once its step happened."""
        states = []
        for c in chunks:
            req = c.req
            if req.num_computed and not req.state and req.seq is not None:
                states.append(self.load(req.seq.block_id(req.num_computed // block_size - 1)))
            else:
                states.append(req.state)
        return states

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

    def save(self, block_id: int, snapshot: torch.Tensor) -> None:
        """Keep `snapshot` ([recurrent layers, hidden] float32, layers in order) as the
        snapshot of `block_id`, replacing any older one. Cannot fail (one assignment):
        the step makes the tensor, and saves it once the step happened."""
        self._by_block[block_id] = snapshot

    def load(self, block_id: int) -> dict[int, torch.Tensor]:
        """The snapshot of `block_id` as {layer: [hidden]} (copies). KeyError if absent:
        the manager only matches blocks whose snapshot was taken."""
        snap = self._by_block[block_id]
        return {layer: snap[i].clone() for i, layer in enumerate(self.layers)}

    def removed(self, block_ids: Iterable[int]) -> None:
        """Listener: blocks left the cache; their snapshots are forgotten."""
        for block in block_ids:
            self._by_block.pop(block, None)

    def offloaded(self, block_ids: list[int], slots: list[int], tokens: array) -> None:
        """Listener: blocks moved to the host; their snapshots go with them."""
        for block, slot in zip(block_ids, slots, strict=True):
            snap = self._by_block.pop(block, None)
            if snap is not None:
                self._by_slot[slot] = snap

    def onboarded(self, slots: list[int], block_ids: list[int], tokens: array) -> None:
        """Listener: host slots moved back to device blocks, snapshots with them."""
        for slot, block in zip(slots, block_ids, strict=True):
            snap = self._by_slot.pop(slot, None)
            if snap is not None:
                self._by_block[block] = snap

    def dropped(self, slots: Iterable[int]) -> None:
        """Listener: host slots dropped; their snapshots are forgotten."""
        for slot in slots:
            self._by_slot.pop(slot, None)

    def cleared(self) -> None:
        """Listener: every cached block was dropped; so is every snapshot."""
        self._by_block.clear()
        self._by_slot.clear()

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._by_block

    @property
    def offloaded_slots(self) -> set[int]:
        """Host slots holding a snapshot (their blocks are offloaded)."""
        return set(self._by_slot)

    @property
    def nbytes(self) -> int:
        """Bytes the kept snapshots occupy (both tiers' blocks)."""
        return (len(self._by_block) + len(self._by_slot)) * self._bytes_each
