"""HostTier: the host pool behind the device pool (TensorRT-LLM's secondary pool).

A full cached block evicted from the device pool is *offloaded*: its edge stays in the
tree, marked `host`, with host slots for blocks, and stays matchable. An admission that
reuses it *onboards* it: device blocks are allocated for it with the admission's own, and
the edge moves back. A host edge evicted for room is *dropped*: its KV is gone. The
manager touches no tensors, so every move is an op (`BlockOffload`, `BlockOnboard`) that
the engine applies in queue order before its next forward pass.

The tree keeps one invariant across tiers: every descendant of a host edge is a host
edge. Eviction takes leaves first, so a device edge is offloaded only once its device
children are gone, and a match walks from the root, so an admission onboards a prefix of
its path; both keep the device part of each scope's tree closed under parents:

    root - A - B - C          device: A, B (B is a device leaf: no device children)
                \\- D - E      host:   C; D, E (D's subtree is wholly on the host)

A device edge is evictable when unreferenced with no device children; a host edge is
droppable when unreferenced with no children at all. Both tiers order candidates by
(retention priority, time of last release), an edge keeping both when it moves; the host
heap, like the device heap, is lazily invalidated. Host edges are referenced only
during an admission (its hits, pinned while it allocates, so its own offloads cannot
drop them); a partial block is never offloaded (it is dropped as without a host tier).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

from kvcache.core.listener import CacheListener
from kvcache.core.ops import CACHE, BlockOffload, BlockOnboard, KvOp
from kvcache.core.radix import BlockRadixTree, Node

Queue = Callable[[Hashable, KvOp], None]  # (owner, op): the manager's op queue


class DevicePool(Protocol):
    """What the host tier needs of the device pool (kvcache/core/pool.py, which imports
    this module): its current tree (reset replaces it) and the stamps of its heap."""

    tree: BlockRadixTree

    def next_stamp(self) -> int: ...


def has_device_child(node: Node) -> bool:
    """True when some child of `node` is a device edge (O(children) at worst)."""
    return any(not child.host for siblings in node.children.values() for child in siblings)


class HostTier:
    """Host slots, the droppable-leaf heap and the moves between tiers.

    Mutated by the device pool `device` (offloads, while it evicts; the two heaps share
    its stamps, so an entry of one is never mistaken for the other's) and by the manager
    (onboards, pins). `queue` receives every op, owned by `CACHE`: an op that moves a
    tree block is never dropped with the sequence that caused it. `listeners` are told of
    every offload, onboard and drop, in order (the KV event log first, when on).
    """

    def __init__(self, num_slots: int, device: DevicePool, queue: Queue,
                 listeners: Iterable[CacheListener] = ()) -> None:
        self.num_slots = num_slots
        self.device = device
        self.queue = queue
        self.listeners: list[CacheListener] = list(listeners)
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.num_droppable = 0  # slots in unreferenced host edges
        self.heap: list[tuple[int, int, int, Node]] = []
        # edges offloaded by the allocation under way: droppable only once it ends, so
        # that an eviction never drops what it has just moved (`settle`)
        self.arriving: list[Node] = []
        self.num_offloaded = self.num_onboarded = self.num_dropped = 0

    @property
    def tree(self) -> BlockRadixTree:
        """The tree (the device pool's: it is replaced on reset)."""
        return self.device.tree

    def reset(self) -> None:
        """Forget every host block (the tree was replaced by an empty one)."""
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.num_droppable = 0
        self.heap = []
        self.arriving = []

    @property
    def num_available(self) -> int:
        """Slots obtainable now: free plus droppable."""
        return len(self.free) + self.num_droppable

    @property
    def num_cached(self) -> int:
        """Slots holding cached blocks."""
        return self.num_slots - len(self.free)

    # ------------------------------------------------------------------ device -> host
    def offload(self, node: Node, n: int) -> tuple[list[int], Node | None] | None:
        """Move the last `n` blocks of device leaf `node` (unreferenced, no device
        children) to the host, queueing one `BlockOffload` per block.

        Returns (the device ids freed, the device edge left above them when only part of
        `node` moved, else None), or None, changing nothing, when `node` is a partial
        block or the host cannot make room for `n` blocks. Makes room by dropping the
        least valuable host leaves (never a referenced edge, nor one the same allocation
        offloaded: the moved edge is droppable only after `settle`).
        """
        if len(node.key) < self.tree.block_bytes or n > self.num_available:
            return None
        slots = self._take(n)
        top = None
        if n < len(node.blocks):
            top = self.tree.split(node, len(node.blocks) - n)  # `node` keeps the tail
        ids = node.blocks
        for block, slot in zip(ids, slots, strict=True):
            self.queue(CACHE, BlockOffload(block, slot))
        if self.listeners:
            tokens = array("I", node.key)
            for listener in self.listeners:
                listener.offloaded(ids, slots, tokens)
        node.blocks = slots
        node.host = True
        self.num_offloaded += n
        self.arriving.append(node)
        return ids, top

    def settle(self) -> None:
        """The allocation that offloaded `arriving` is over: those edges still on the host
        become droppable."""
        for node in self.arriving:
            if node.host and node.parent is not None:
                self.num_droppable += len(node.blocks)
                if not node.children and not node.ref:
                    self.push(node)
        self.arriving = []

    def _take(self, n: int) -> list[int]:
        """`n` free slots, dropping host leaves by priority, then LRU, as needed (the
        caller checked `num_available`)."""
        free, heap, tree = self.free, self.heap, self.tree
        while len(free) < n:
            assert heap, f"host drop ran dry with {n - len(free)} slots still needed"
            _, _, stamp, node = heap[0]
            if (node.stamp != stamp or node.ref or node.children or node.parent is None
                    or not node.host):
                heapq.heappop(heap)
                continue
            dropping = min(len(node.blocks), n - len(free))
            if dropping < len(node.blocks):  # drop the tail of the edge; its entry stays valid
                gone = tree.trim(node, dropping)
            else:
                heapq.heappop(heap)
                gone = node.blocks
                parent = tree.detach(node)
                if (parent.host and not parent.ref and not parent.children
                        and not any(edge is parent for edge in self.arriving)):
                    self.push(parent)
            self._dropped(gone)
            free += gone
        out = free[len(free) - n:]
        del free[len(free) - n:]
        return out

    def drop_subtree(self, node: Node) -> None:
        """Drop every (host, unreferenced) edge below device edge `node`, so that `node`
        can leave the tree when the host has no room for it."""
        below: list[Node] = []  # parents before children
        stack = [child for siblings in node.children.values() for child in siblings]
        while stack:
            edge = stack.pop()
            assert edge.host and not edge.ref, edge
            below.append(edge)
            stack += [child for siblings in edge.children.values() for child in siblings]
        for edge in reversed(below):  # children first: detach takes leaves only
            self.tree.detach(edge)
            self.forget(edge)

    def forget(self, node: Node) -> None:
        """Host edge `node` left the tree (detached by the caller): its slots are free,
        its blocks dropped."""
        assert node.host and not node.ref, node
        if any(edge is node for edge in self.arriving):  # not counted droppable yet
            self.arriving = [edge for edge in self.arriving if edge is not node]
            self.num_droppable += len(node.blocks)
        self._dropped(node.blocks)
        self.free += node.blocks

    def _dropped(self, slots: list[int]) -> None:
        self.num_droppable -= len(slots)
        self.num_dropped += len(slots)
        for listener in self.listeners:
            listener.dropped(slots)

    def push(self, node: Node) -> None:
        """Register unreferenced host leaf `node` as droppable (older entries go stale)."""
        stamp = node.stamp = self.device.next_stamp()
        heapq.heappush(self.heap, (node.priority, node.last_used, stamp, node))
        if len(self.heap) > 2 * self.tree.num_nodes + 1024:
            self.heap[:] = [entry for entry in self.heap if self._droppable(entry)]
            heapq.heapify(self.heap)

    @staticmethod
    def _droppable(entry: tuple[int, int, int, Node]) -> bool:
        """Whether heap entry `entry` is live: its node's latest, an unreferenced host
        leaf still in the tree."""
        _, _, stamp, node = entry
        return (node.stamp == stamp and node.host and not node.ref and not node.children
                and node.parent is not None)

    # ------------------------------------------------------------------ host -> device
    def pin_chain(self, deep: Node, priority: int) -> list[Node]:
        """Reference the host edges from `deep` up to the first device edge, so that no
        drop takes them while their admission allocates; returns them top-down."""
        chain: list[Node] = []
        node: Node | None = deep
        while node is not None and node.host:
            self.pin(node, priority)
            chain.append(node)
            node = node.parent
        chain.reverse()
        return chain

    def pin(self, node: Node, priority: int) -> None:
        """Reference host edge `node` (an admission's hit or copy source)."""
        if node.ref == 0:
            self.num_droppable -= len(node.blocks)
            node.priority = priority
        elif priority > node.priority:
            node.priority = priority
        node.ref += 1

    def unpin(self, node: Node, clock: int) -> None:
        """Drop the reference `pin` took on host edge `node` (a copy source, once its
        copy is queued); released at logical time `clock`, like a device edge."""
        node.ref -= 1
        if node.ref == 0:
            node.last_used = clock
            self.num_droppable += len(node.blocks)
            if not node.children:
                self.push(node)

    def onboard(self, chain: list[Node], block_ids: list[int]) -> list[int]:
        """Move the pinned host edges `chain` (top-down) to device blocks `block_ids`,
        queueing one whole-block `BlockOnboard` each; their slots become free. The edges
        stay referenced (by their admission). Returns the device ids in chain order."""
        block_size = self.tree.tokens_per_block
        at = 0
        for node in chain:
            count = len(node.blocks)
            slots = self.move_to_device(node, block_ids[at:at + count])
            for slot, block in zip(slots, node.blocks, strict=True):
                self.queue(CACHE, BlockOnboard(slot, block, block_size))
            at += count
        self.num_onboarded += at
        return block_ids[:at]

    def move_to_device(self, node: Node, block_ids: list[int]) -> list[int]:
        """Give host edge `node` the device blocks `block_ids` (holding, or about to
        hold, the same KV) and free its slots; returns the slots. The caller accounts
        for `node` on the device (referenced, or evictable)."""
        slots = node.blocks
        if self.listeners:
            tokens = array("I", node.key)
            for listener in self.listeners:
                listener.onboarded(slots, block_ids, tokens)
        node.blocks = list(block_ids)
        node.host = False
        self.free += slots
        return slots
