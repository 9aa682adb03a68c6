"""Invariants of the tree, the pool and the sequences, checked from scratch.

Slow on purpose (it recomputes everything the hot path keeps incrementally); tests call
it after mutations and the harness plugin after every test that owns a cache, with the
leak report (`leak_report`) once the test is done.

Under full attention a holder holds a whole chain from its scope root, so a referenced
node's parent is referenced and only leaves are evictable. Under a sliding window
(`KvCacheConfig.sliding_window`) a sequence holds the segment of its chain from its first
unreleased block down, every unreferenced node with blocks is evictable, and evicted
interior nodes stay as hollow path nodes: blockless, unreferenced, never leaves.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from kvcache.core.keys import TOKEN_BYTES
from kvcache.core.ops import CACHE
from kvcache.core.radix import Node
from kvcache.core.window import first_held_block

if TYPE_CHECKING:
    from kvcache.core.handle import SequenceHandle
    from kvcache.core.host_tier import HostTier
    from kvcache.core.pool import BlockPool
    from kvcache.core.radix import BlockRadixTree
    from kvcache.core.state import CacheState


class IntegrityError(AssertionError):
    """A broken invariant; the message names it and the objects involved."""


def _fail(msg: str) -> NoReturn:
    raise IntegrityError(msg)


def _chain(node: Node | None) -> list[Node]:
    out = []
    while node is not None and node.parent is not None:
        out.append(node)
        node = node.parent
    return out


class _Owners:
    """Who owns each device block, claimed one at a time: every block exactly once."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.owner: dict[int, str] = {}

    def own(self, block: int, where: str) -> None:
        """Claim `block` for `where`; IntegrityError if it is out of range or owned."""
        if not 0 <= block < self.num_blocks:
            _fail(f"block id {block} ({where}) is outside [0, {self.num_blocks})")
        if block in self.owner:
            _fail(f"block {block} is owned twice: by {self.owner[block]} and by {where}")
        self.owner[block] = where

    def check_all_owned(self) -> None:
        """IntegrityError naming the blocks nobody claimed (leaked)."""
        missing = set(range(self.num_blocks)) - self.owner.keys()
        if missing:
            _fail(f"blocks {sorted(missing)[:10]} are owned by nobody (leaked)")


class _TreeCounts:
    """What the walk of the tree finds, to compare with what the pools count."""

    def __init__(self) -> None:
        self.nodes = 0
        self.evictable = 0  # device blocks in unreferenced edges
        self.droppable = 0  # host slots in (unreferenced) host edges
        self.slots: dict[int, str] = {}  # host slot -> its owner


def check_state(state: CacheState) -> None:
    """Raise IntegrityError naming the first broken invariant of a manager's `state`
    (reads only its public fields)."""
    pool = state.pool
    owners = _Owners(pool.num_blocks)
    expected_ref: Counter[int] = Counter()
    for i, block in enumerate(pool.free):
        owners.own(block, f"free list[{i}]")
    for seq in state.handles.values():
        _check_sequence(state, seq, expected_ref, owners.own)
    windowed = state.config.sliding_window is not None
    if windowed != pool.windowed:
        _fail(f"the pool's windowed={pool.windowed} disagrees with sliding_window="
              f"{state.config.sliding_window}")
    counts = _check_tree(state.tree, pool, expected_ref, owners, windowed)
    if counts.nodes != state.tree.num_nodes:
        _fail(f"tree counts {state.tree.num_nodes} nodes but holds {counts.nodes}")
    if counts.evictable != pool.num_evictable:
        _fail(f"pool counts {pool.num_evictable} evictable blocks, the tree has "
              f"{counts.evictable}")
    owners.check_all_owned()
    if pool.host is not None:
        _check_host_slots(pool.host, counts.slots, counts.droppable)
    _check_queued_ops(state)


def _check_tree(tree: BlockRadixTree, pool: BlockPool, expected_ref: Counter[int],
                owners: _Owners, windowed: bool) -> _TreeCounts:
    """Check every node of `tree` and claim its blocks and slots; returns the counts."""
    block_bytes = tree.block_bytes
    live_heap = {id(node) for _, _, stamp, node in pool.heap if node.stamp == stamp}
    host = pool.host
    host_heap = {id(node) for _, _, stamp, node in host.heap
                 if node.stamp == stamp} if host is not None else set()
    counts = _TreeCounts()
    for key, node in tree.walk():
        counts.nodes += 1
        where = f"node {node!r} in scope {key!r}"
        _check_node_shape(node, where, block_bytes, windowed)
        if node.ref != expected_ref[id(node)]:
            _fail(f"{where}: ref {node.ref} but {expected_ref[id(node)]} holders")
        parent = node.parent
        assert parent is not None  # _check_node_shape checked it
        if node.ref and parent.parent is not None and not parent.ref and not windowed:
            _fail(f"{where} is referenced but its parent {parent!r} is not")
        _check_child_index(node, block_bytes, where)
        if node.host:
            counts.droppable += _check_host_node(node, where, host, host_heap, counts.slots)
            continue
        if parent.host:
            _fail(f"{where} is on the device under host edge {parent!r}")
        if not node.ref:
            counts.evictable += len(node.blocks)
            device_leaf = not any(not child.host for siblings in node.children.values()
                                  for child in siblings)
            if (node.blocks and (windowed or device_leaf)
                    and id(node) not in live_heap):
                _fail(f"{where} is an unreferenced evictable node missing from the eviction "
                      "heap")
        for i, block in enumerate(node.blocks):
            owners.own(block, f"{where} block {i}")
    for key, root in tree.roots.items():
        _check_child_index(root, block_bytes, f"root of scope {key!r}")
    return counts


def _check_node_shape(node: Node, where: str, block_bytes: int, windowed: bool) -> None:
    """Check `node`'s place under its parent, its index keys, and its blocks against its
    tokens (full blocks, a partial leaf, or hollow under a sliding window)."""
    parent = node.parent
    if parent is None or node not in parent.children.get(node.first, ()):
        _fail(f"{where} is not indexed under its parent by its first token")
    if node.first != node.key[:TOKEN_BYTES] or not node.key:
        _fail(f"{where}: first-token index key does not match its tokens")
    if node.head != (node.key[:block_bytes] if len(node.key) >= block_bytes else None):
        _fail(f"{where}: first-block index key does not match its tokens")
    if not node.blocks:
        if not windowed or node.ref or not node.children or len(node.key) % block_bytes:
            _fail(f"{where}: a hollow node must be an unreferenced run of full blocks with "
                  f"children, under a sliding window (windowed={windowed})")
    elif len(node.key) < block_bytes:
        if len(node.blocks) != 1 or node.children or len(node.key) % TOKEN_BYTES:
            _fail(f"{where}: a partial block must be a single-block leaf")
    elif len(node.key) != len(node.blocks) * block_bytes:
        _fail(f"{where}: {len(node.key) // TOKEN_BYTES} tokens for "
              f"{len(node.blocks)} full blocks")


def _check_queued_ops(state: CacheState) -> None:
    """Every queued op of a sequence belongs to a live one and targets its private
    blocks (CACHE's moves of cached blocks between tiers belong to no sequence)."""
    for seq_id, op in state.op_queue:
        if seq_id is CACHE:
            continue
        holder = state.handles.get(seq_id)
        if holder is None:
            _fail(f"copy op {op} belongs to freed sequence {seq_id!r}")
        elif op.dst not in holder.block_ids[holder.holdings.tree_blocks:]:
            _fail(f"copy op {op} of sequence {seq_id!r} targets block {op.dst}, not one of "
                  "its private blocks")


def _check_host_node(node: Node, where: str, host: HostTier | None, heap: set[int],
                     slots: dict[int, str]) -> int:
    """Check host edge `node`, claim its slots; returns its droppable slots."""
    if host is None:
        _fail(f"{where} is on the host, but the manager has no host tier")
    if node.ref:
        _fail(f"{where} is a host edge with holders: only device blocks are held")
    if len(node.key) < host.tree.block_bytes:
        _fail(f"{where} is a partial block on the host: only full blocks are offloaded")
    if not node.children and id(node) not in heap:
        _fail(f"{where} is an unreferenced host leaf missing from the host drop heap")
    for i, slot in enumerate(node.blocks):
        if not 0 <= slot < host.num_slots:
            _fail(f"host slot {slot} ({where} block {i}) is outside [0, {host.num_slots})")
        if slot in slots:
            _fail(f"host slot {slot} is owned twice: by {slots[slot]} and by {where}")
        slots[slot] = f"{where} block {i}"
    return len(node.blocks)


def _check_host_slots(host: HostTier, slots: dict[int, str], droppable: int) -> None:
    for slot in host.free:
        if slot in slots:
            _fail(f"host slot {slot} is free and owned by {slots[slot]}")
        slots[slot] = "the host free list"
    if len(host.free) != len(set(host.free)):
        _fail("a host slot is on the free list twice")
    missing = set(range(host.num_slots)) - slots.keys()
    if missing:
        _fail(f"host slots {sorted(missing)[:10]} are owned by nobody (leaked)")
    if droppable != host.num_droppable:
        _fail(f"host tier counts {host.num_droppable} droppable slots, the tree has "
              f"{droppable}")


def _check_child_index(node: Node, block_bytes: int, where: str) -> None:
    children = [child for siblings in node.children.values() for child in siblings]
    full = {child.key[:block_bytes]: child for child in children
            if len(child.key) >= block_bytes}
    if len(full) != sum(len(child.key) >= block_bytes for child in children):
        _fail(f"{where}: two full children start with the same block (not deduplicated)")
    if full != node.full:
        _fail(f"{where}: its first-block index of full children is stale")


def _check_sequence(state: CacheState, seq: SequenceHandle, expected_ref: Counter[int],
                    own: Callable[[int, str], None]) -> None:
    """Check live `seq`'s counts and window against its tokens, then the path it holds
    (`_check_held_path`); count its references in `expected_ref`, claim its private
    blocks with `own`."""
    block_size = state.config.tokens_per_block
    window = state.config.sliding_window
    where = f"sequence {seq.seq_id!r}"
    num_tokens = len(seq.tokens)
    committed = seq.num_committed_tokens
    num_blocks = len(seq.block_ids)
    most = (num_tokens + block_size - 1) // block_size
    # Under a sliding window prompt blocks come as chunks reserve them.
    least = (committed + block_size - 1) // block_size if window is not None else most
    if not least <= num_blocks <= most:
        _fail(f"{where}: {num_blocks} blocks for {num_tokens} tokens ({committed} committed)")
    if not seq.num_cached_tokens <= committed <= num_tokens:
        _fail(f"{where}: cached {seq.num_cached_tokens} <= committed "
              f"{committed} <= tokens {num_tokens} does not hold")
    _, tree_blocks, first = seq.holdings
    if state.reuse and tree_blocks != committed // block_size:
        _fail(f"{where}: {tree_blocks} blocks in the tree, committed {committed} tokens")
    expected_first = 0 if window is None else first_held_block(
        committed, window - 1, block_size, tree_blocks if state.reuse else None)
    if first != expected_first:
        _fail(f"{where}: {first} blocks released, the window of position {committed} "
              f"releases {expected_first}")
    ids = seq.block_ids
    if any(block is not None for block in ids[:first]) or None in ids[first:]:
        _fail(f"{where}: block ids {list(ids)} are not None exactly before "
              f"position {first}")
    _check_held_path(state, seq, where, expected_ref, own)


def _check_held_path(state: CacheState, seq: SequenceHandle, where: str,
                     expected_ref: Counter[int], own: Callable[[int, str], None]) -> None:
    """The tree path `seq` holds spells its first blocks in its scope, its held segment
    has blocks and starts on a node boundary, and its ids are the path's."""
    last, tree_blocks, first = seq.holdings
    chain = _chain(last)
    keys = b"".join(node.key for node in reversed(chain))
    if keys != array("I", seq.tokens[:tree_blocks * state.config.tokens_per_block]).tobytes():
        _fail(f"{where}: the tree path it holds does not spell its first "
              f"{tree_blocks} blocks")
    scope_root = state.tree.roots.get(seq.scope)
    top = chain[-1].parent if chain else None
    if chain and top is not scope_root:
        _fail(f"{where}: holds a path outside its scope {seq.scope!r}")
    path_blocks: list[int | None] = []
    for node in reversed(chain):
        path_blocks += node.blocks or [None] * (len(node.key) // state.tree.block_bytes)
    end = tree_blocks
    for node in chain:  # the held segment: from `last` up to the node starting at `first`
        if end <= first:
            if end < first:
                _fail(f"{where}: no node boundary at its first held block {first}")
            break
        if not node.blocks:
            _fail(f"{where}: holds hollow node {node!r}")
        expected_ref[id(node)] += 1
        end -= len(node.blocks)
    for i, block in enumerate(seq.block_ids):
        if block is None:
            continue
        if i < tree_blocks and block != path_blocks[i]:
            _fail(f"{where}: block {i} is {block}, the tree holds {path_blocks[i]}")
        elif i >= tree_blocks:
            own(block, f"{where} private block {i}")


def leak_report(state: CacheState) -> list[str]:
    """One line per leak of a manager's `state`: live sequences, copies never taken, and
    with nothing live, stray references and blocks or host slots neither free nor evictable."""
    lines = [f"sequence {seq.seq_id!r} is still live, holding {len(seq.live_block_ids())} "
             "blocks" for seq in state.handles.values()]
    # a sequence's copies die with it; moves of cached blocks (CACHE's) wait for the
    # next step's take, whenever it comes: pending, not leaked
    copies = sum(owner is not CACHE for owner, _ in state.op_queue)
    if copies:
        lines.append(f"{copies} copy ops were never taken")
    if not state.handles:
        lines += [f"node {node!r} in scope {key!r} has ref {node.ref} with no live sequence"
                  for key, node in state.tree.walk() if node.ref]
    free = state.pool.num_available
    if not state.handles and free != state.pool.num_blocks:
        lines.append(f"{state.pool.num_blocks - free} blocks are neither free nor evictable")
    host = state.pool.host
    if not state.handles and host is not None and host.num_available != host.num_slots:
        lines.append(f"{host.num_slots - host.num_available} host slots are neither free "
                     "nor droppable")
    return lines
