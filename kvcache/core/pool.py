"""BlockPool: free blocks, reference counts and the priority-LRU of evictable leaves.

Every block id is in exactly one place: the free stack (no cached content), a tree node
(cached; evictable when unreferenced) or a sequence's private list. The pool keeps a
running count of unreferenced cached blocks, so "how many blocks could I get" is O(1),
and a heap of evictable nodes ordered by (priority, time of last release) with lazy
invalidation, so eviction never scans the pool. Under full attention only leaves are
evictable; under a sliding window (`windowed`) every unreferenced node with blocks is,
and evicting an interior one leaves it hollow (see `Node`). With a host tier (`host`;
never under a sliding window), an evicted full block is offloaded there rather than
dropped (kvcache/core/host_tier.py), and an edge whose children are all on the host is a
leaf of the device pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from kvcache.core.host_tier import HostTier, has_device_child
from kvcache.core.radix import BlockRadixTree, Node


class Allocation(NamedTuple):
    """Blocks handed out by the pool: `block_ids`, the first `num_fresh` of them from the
    free list (the rest evicted cached blocks), and the host tier's offloads and drops
    that the evictions made (0 without a host tier; `CacheState.allocate` counts them)."""

    block_ids: list[int]
    num_fresh: int
    num_offloaded: int = 0
    num_dropped: int = 0


class OutOfBlocksError(RuntimeError):
    """Not enough free or evictable blocks; the cache is left exactly as it was."""

    def __init__(self, where: str, needed: int, available: int, capacity: int) -> None:
        self.needed = needed
        self.available = available
        self.capacity = capacity
        never = " (more than the whole pool: it can never fit)" if needed > capacity else ""
        super().__init__(f"{where}: needs {needed} new blocks, {available} free or evictable "
                         f"of {capacity}{never}")

    @property
    def can_never_fit(self) -> bool:
        """True when even an empty pool could not satisfy the request."""
        return self.needed > self.capacity


class BlockPool:
    """Owns block ids and the eviction order; the tree owns the structure."""

    def __init__(self, num_blocks: int, tree: BlockRadixTree, windowed: bool = False) -> None:
        self.num_blocks = num_blocks
        self.tree = tree
        self.windowed = windowed
        # Popped from the end: low ids first, which keeps small tests readable.
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.num_evictable = 0  # blocks in unreferenced tree nodes
        self.heap: list[tuple[int, int, int, Node]] = []
        self._stamp = 0
        self.clock = 0  # logical time: advanced once per release of a holder
        self.num_evicted = 0
        self.host: HostTier | None = None  # the host tier, when there is one

    def reset(self, tree: BlockRadixTree) -> None:
        """Forget every cached block: all blocks become free, `tree` (empty) replaces the
        old tree. Only valid while no block is referenced; the clock and the eviction
        count carry on."""
        self.tree = tree
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.num_evictable = 0
        self.heap = []
        if self.host is not None:
            self.host.reset()

    def next_stamp(self) -> int:
        """A fresh heap stamp (shared with the host tier's heap)."""
        self._stamp += 1
        return self._stamp

    def device_leaf(self, node: Node) -> bool:
        """True when `node` has no children on the device (its eviction order matters)."""
        return not node.children or (self.host is not None and not has_device_child(node))

    @property
    def num_available(self) -> int:
        """Blocks obtainable now: free plus evictable."""
        return len(self.free) + self.num_evictable

    def acquire(self, deepest: Node, stop: Node | None, priority: int) -> None:
        """Take one reference on every node from `deepest` up to (excluding) `stop`.

        `stop=None` means up to the root. A node's retention priority is the highest of
        its holders' since it was last unreferenced.
        """
        node = deepest
        parent = node.parent
        while node is not stop and parent is not None:  # the root has no parent
            if node.ref == 0:
                self.num_evictable -= len(node.blocks)
                node.priority = priority
            elif priority > node.priority:
                node.priority = priority
            node.ref += 1
            node = parent
            parent = node.parent

    def tick(self) -> None:
        """Advance logical time: releases after this are more recent than those before."""
        self.clock += 1

    def release(self, deepest: Node, stop: Node | None = None) -> None:
        """Drop one reference on `deepest` and its ancestors up to (excluding) `stop`;
        `stop=None` releases a holder's whole chain. Unreferenced nodes become evictable.

        After a whole-chain release, edges that admissions split are merged back wherever
        parent and only child are alike again in holders, time and priority, so later
        walks stay short. (Under a sliding window equal counts need not mean the same
        holders, as holders hold segments: only unreferenced edges merge there.)
        """
        windowed = self.windowed
        node = deepest
        parent = node.parent
        while node is not stop and parent is not None:  # the root has no parent
            node.ref -= 1
            if node.ref == 0:
                node.last_used = self.clock
                self.num_evictable += len(node.blocks)
                if windowed or not node.children or (self.host is not None
                                                     and not has_device_child(node)):
                    self.push(node)
            node = parent
            parent = node.parent
        if stop is not None:
            return
        node = deepest
        while True:
            top = node.parent
            if top is None or top.parent is None:
                return
            if (len(top.children) == 1 and top.ref == node.ref
                    and top.last_used == node.last_used and top.priority == node.priority
                    and node.head is not None and len(top.children[node.first]) == 1
                    and (not windowed or (node.ref == 0 and top.blocks))):
                self.tree.merge(top, node)
            else:
                node = top

    def split(self, node: Node, nblocks: int) -> Node:
        """`tree.split(node, nblocks)`; under a sliding window an unreferenced upper part
        is registered as evictable (the lower part keeps the node's heap entries)."""
        top = self.tree.split(node, nblocks)
        if self.windowed and not top.ref and top.blocks:
            self.push(top)
        return top

    def push(self, node: Node) -> None:
        """Register unreferenced `node` as evictable (older entries go stale)."""
        self._stamp += 1
        node.stamp = self._stamp
        heapq.heappush(self.heap, (node.priority, node.last_used, self._stamp, node))
        if len(self.heap) > 2 * self.tree.num_nodes + 1024:
            self._compact()

    def add_cached(self, node: Node, priority: int) -> None:
        """Account a freshly attached unreferenced node (a committed partial tail)."""
        node.priority = priority
        node.last_used = self.clock
        self.num_evictable += len(node.blocks)
        self.push(node)

    def hold_new(self, node: Node, priority: int) -> None:
        """Account a freshly attached node whose only holder is the sequence that
        committed it (its parent chain is already held by that sequence)."""
        assert node.ref == 0 and not node.children
        node.ref = 1
        node.priority = priority

    def give_back(self, block_ids: Sequence[int]) -> None:
        """Return blocks that hold no cached content (a sequence's private ones)."""
        self.free += block_ids

    @property
    def num_free(self) -> int:
        """Blocks holding no cached content."""
        return len(self.free)

    def forget_cached(self, node: Node) -> None:
        """Account an unreferenced node leaving the tree without eviction (a claim)."""
        assert node.ref == 0
        self.num_evictable -= len(node.blocks)

    def allocate(self, num_blocks: int) -> Allocation:
        """Hand out `num_blocks` blocks: free ones first, then evicted ones.

        Returns their ids and how many came from the free stack (the host tier's counts
        left 0). The caller has checked `num_available`; running short here is an
        internal error.
        """
        free = self.free
        if num_blocks <= len(free):
            cut = len(free) - num_blocks
            ids = free[cut:]
            del free[cut:]
            return Allocation(ids, num_blocks)
        ids = free[:]
        free.clear()
        fresh = len(ids)
        ids += self._evict(num_blocks - fresh)
        return Allocation(ids, fresh)

    def evict_below(self, node: Node) -> list[int]:
        """Evict what follows the first block of unreferenced `node`: the rest of its edge
        and every node below it (unreferenced too, as `node` is). Returns their device
        ids (edges below on the host tier are dropped); `node` is left an unreferenced
        single-block leaf (its heap entries go stale)."""
        assert node.ref == 0, node
        tree = self.tree
        below: list[Node] = []  # parents before children
        stack = [child for siblings in node.children.values() for child in siblings]
        while stack:
            edge = stack.pop()
            below.append(edge)
            stack += [child for siblings in edge.children.values() for child in siblings]
        out: list[int] = []
        for edge in reversed(below):  # children before parents: detach takes leaves only
            tree.detach(edge)
            if edge.host and self.host is not None:
                self.host.forget(edge)
            else:
                out += edge.blocks
        if len(node.blocks) > 1:
            out += tree.trim(node, len(node.blocks) - 1)
        self.num_evictable -= len(out)
        self.num_evicted += len(out)
        return out

    def _evict(self, need: int) -> list[int]:
        """Evict `need` cached blocks, least valuable first (priority, then LRU), and
        return their ids: with a host tier a full block is offloaded there, else
        dropped (under a sliding window an interior one leaves its node hollow)."""
        heap = self.heap
        tree = self.tree
        host = self.host
        out: list[int] = []
        while need:
            assert heap, f"eviction ran dry with {need} blocks still needed"
            _, _, stamp, node = heap[0]
            if not self._evictable(node, stamp):
                heapq.heappop(heap)
                continue
            count = len(node.blocks)
            if host is not None:
                moving = min(count, need)
                moved = host.offload(node, moving)
                if moved is not None:
                    out += moved[0]
                    need -= moving
                    self.num_evictable -= moving
                    self.num_evicted += moving
                    heapq.heappop(heap)  # `node` is a host edge now
                    self._after_offload(node, moved[1])
                    continue
                if node.children:  # no room on the host: its host subtree goes first
                    host.drop_subtree(node)
            if node.children:  # windowed: the blocks go, the path stays (hollow)
                if count > need:  # the front of the edge; the rest keeps its heap entry
                    node = tree.split(node, need)
                else:
                    heapq.heappop(heap)
                out += tree.hollow(node)
                taken = min(count, need)
                need -= taken
                self.num_evictable -= taken
                self.num_evicted += taken
                continue
            if count > need:  # evict the tail of the edge; its entry stays valid
                out += tree.trim(node, need)
                self.num_evictable -= need
                self.num_evicted += need
                break
            heapq.heappop(heap)
            out += node.blocks
            need -= count
            self.num_evictable -= count
            self.num_evicted += count
            parent = node.parent
            assert parent is not None
            tree.prune(node)
            if (not self.windowed and parent.parent is not None and parent.ref == 0
                    and self.device_leaf(parent)):
                self.push(parent)
        if host is not None:
            host.settle()
        return out

    def _after_offload(self, node: Node, top: Node | None) -> None:
        # the device edge left above the offloaded blocks is a leaf of the device pool now:
        # the rest of a split edge, or the parent whose last device child this was
        above = top if top is not None else node.parent
        assert above is not None
        if above.parent is not None and above.ref == 0 and self.device_leaf(above):
            self.push(above)

    def _evictable(self, node: Node, stamp: int) -> bool:
        """Whether heap entry (`node`, `stamp`) is live: the node's latest entry, still in
        the tree, unreferenced, with device blocks, and a leaf of the device pool unless
        windowed."""
        return (node.stamp == stamp and not node.ref and node.parent is not None
                and bool(node.blocks) and not node.host
                and (self.windowed or self.device_leaf(node)))

    def _compact(self) -> None:
        # in place: _evict may be iterating over this very list
        self.heap[:] = [entry for entry in self.heap if self._evictable(entry[3], entry[2])]
        heapq.heapify(self.heap)
