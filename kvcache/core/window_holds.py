"""What a sequence holds under a sliding window: a segment of its tree chain.

The manager's helpers for `KvCacheConfig.sliding_window` (the arithmetic is in
`window.py`). A sequence references the chain from the node holding its first unreleased
block position down to `last`:

    root ── [b0 b1 b2] ── [b3 b4] ── [b5 b6 b7]        blocks 0..7 in the tree
                 released    │ held segment, first = 3 │
                             └──────── ref +1 ─────────┘

The segment starts on a node boundary (split there when it is set) and is found again by
walking up from `last`, so a split elsewhere never moves it. Callers are the manager's
mutators; these functions change the tree, the pool and the sequence as documented.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache.core.radix import Node, PartialHit
from kvcache.core.window import window_hit

if TYPE_CHECKING:
    from kvcache.core.handle import SequenceRecord
    from kvcache.core.kv_event_log import KvEventLog
    from kvcache.core.pool import BlockPool

Hits = list[tuple[Node, int]]


def cut_hits(hits: Hits, keep: int) -> Hits:
    """The first `keep` blocks of `hits` (pairs of node, blocks matched from its start)."""
    out: Hits = []
    left = keep
    for node, matched in hits:
        if not left:
            break
        out.append((node, min(matched, left)))
        left -= out[-1][1]
    return out


def held_ids(hits: Hits, first: int, available: int) -> tuple[list[int], int]:
    """Ids of the matched blocks from position `first` on, and the blocks available once
    they are held (`available` less the unreferenced ones among them)."""
    ids: list[int] = []
    pos = 0
    for node, matched in hits:
        low = first - pos if first > pos else 0
        if low < matched:
            ids += node.blocks[low:matched]
            if not node.ref:
                available -= matched - low  # about to be referenced
        pos += matched
    return ids, available


def cut_to_window(hits: Hits, num_full: int, partial: PartialHit | None, window_left: int,
                  block_size: int, alignment: int
                  ) -> tuple[Hits, int, PartialHit | None, int, int]:
    """A match (`num_full` full blocks of `hits`, then `partial`) cut to the
    sliding-window rule, its full blocks to a multiple of `alignment`: (hits, full
    blocks, partial hit, tokens, first held block). Hollow nodes on the path are its
    missing blocks."""
    holes = []
    pos = 0
    for node, matched in hits:
        if not node.blocks:
            holes.append((pos, pos + matched))
        pos += matched
    cut = window_hit(holes, num_full, partial.num_tokens if partial is not None else 0,
                     window_left, block_size, alignment)
    kept = cut.num_full_blocks
    if kept < num_full:
        hits = cut_hits(hits, kept)
    if not cut.keep_partial:
        partial = None
    num_tokens = kept * block_size + (partial.num_tokens if partial is not None else 0)
    return hits, kept, partial, num_tokens, cut.first_block


def segment_stop(pool: BlockPool, deep: Node, end: int, first: int) -> Node:
    """The node just above the segment from block position `first` to `deep` (which ends
    at position `end`); splits the node holding `first` there if it starts before it
    (`pool.split`). Every node of the segment has blocks."""
    node = deep
    start = end - len(node.blocks)
    while start > first:
        parent = node.parent
        assert parent is not None and parent.blocks, (node, start, first)
        node = parent
        start -= len(node.blocks)
    if start < first:
        return pool.split(node, first - start)
    assert node.parent is not None
    return node.parent


def release_front(pool: BlockPool, record: SequenceRecord, new: int, reuse: bool) -> None:
    """Release block positions [record.num_released_blocks, new) of `record`: its
    references to cached ones (they stay in the tree, evictable), or with reuse off its
    private ones (back to the free list). Their positions become None."""
    old = record.num_released_blocks
    if reuse:
        last = record.last_node
        assert last is not None
        upper = segment_stop(pool, last, record.num_tree_blocks, new)  # the node ending at `new`
        pool.release(upper, segment_stop(pool, upper, new, old) if old else None)
    else:
        pool.give_back(record.live_block_ids(old, new))
    record.block_ids[old:new] = [None] * (new - old)
    record.num_released_blocks = new


def unheld_below(node: Node) -> bool:
    """Whether no node below `node` is referenced: under full attention always true of
    an unreferenced node, under a window not (a held segment can hang below)."""
    stack = [child for siblings in node.children.values() for child in siblings]
    while stack:
        below = stack.pop()
        if below.ref:
            return False
        stack += [child for siblings in below.children.values() for child in siblings]
    return True


def take_path(record: SequenceRecord, nodes: list[Node], start: int, block_bytes: int,
              kv_event_log: KvEventLog | None) -> list[int]:
    """`record` now holds `nodes`, the tree's copies of its blocks from position `start`
    on: it switches to their blocks and returns its own there (for the caller to give
    back), except where a node is hollow (its blocks evicted under a sliding window):
    that node takes the sequence's blocks (a BlockStored event) and nothing switches;
    nor does it where a node holds the sequence's own blocks already (taken back from
    the host tier)."""
    own: list[int] = []
    for node in nodes:
        count = len(node.key) // block_bytes
        mine = record.live_block_ids(start, start + count)
        if node.blocks:
            if node.blocks != mine:
                own += mine
                record.block_ids[start:start + count] = node.blocks
        else:
            node.blocks = mine  # referenced already, so not evictable: no count changes
            if kv_event_log is not None:
                kv_event_log.stored(record.seq_id, record.tokens, record.scope, start, mine)
        start += count
    return own
