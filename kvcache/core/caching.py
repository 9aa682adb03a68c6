"""Caching a sequence's KV in the tree: its committed full blocks, and its partial tail.

`cache_full_blocks` is the tree side of `KVCacheManager.commit`: blocks equal to ones
already cached are deduplicated (the sequence switches to them), the rest become an edge
the sequence holds. `cache_tail` runs at `free_sequence` with partial reuse on. Both
read and write the manager's private state; the manager is their only caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache.core.handle import Sequence
from kvcache.core.radix import TOKEN_BYTES, Node
from kvcache.core.window_holds import take_path

if TYPE_CHECKING:
    from kvcache.core.manager import KVCacheManager


def cache_full_blocks(mgr: KVCacheManager, seq: Sequence, nfull: int) -> None:
    """Put the committed full blocks of `seq` from its `tree_blocks` up to `nfull` into
    the tree: a leaf only it holds grows in place; otherwise blocks equal to cached ones
    switch to those (its own go back to the pool, `block_ids_version` is bumped; a host
    copy takes its blocks instead) and the rest become a new edge it holds."""
    B = mgr._B
    t = seq._tree_blocks
    deep = seq._last
    tree = mgr.tree
    if deep is not None and deep.ref == 1 and not deep.children:
        # a leaf only this sequence holds: grow it in place, the tree stays compressed
        tree.extend_leaf(deep, seq._tokens[t * B:nfull * B].tobytes(),
                         seq.live_block_ids(t, nfull))
        if mgr._kv is not None:
            mgr._kv.stored(seq._seq_id, seq._tokens, seq._scope, t,
                           seq.live_block_ids(t, nfull))
        seq._tree_blocks = nfull
        return
    parent = deep if deep is not None else tree.root(seq._scope)
    kb = seq._tokens[t * B:nfull * B].tobytes()
    bb = tree.block_bytes
    first = parent.full.get(kb[:bb])
    if first is not None:  # someone committed the same blocks first: switch to theirs
        if len(kb) == bb:  # one block (a decode step's): the index lookup matched it
            hits, k = [(first, 1)], 1
        else:
            m = tree.match(parent, kb, len(kb), False, False)
            hits, k = m.hits, m.num_full_blocks
        last, nb = hits[-1]
        top = mgr.pool.split(last, nb) if nb * bb < len(last.key) else last
        if top.host:  # those on the host take this sequence's own blocks, no copy
            _adopt(mgr, top, seq.live_block_ids(t, t + k))
        mgr.pool.acquire(top, parent, seq._priority)
        own = take_path(seq, [*(n for n, _ in hits[:-1]), top], t, bb, mgr._kv)
        if own:
            seq._block_ids_version += 1
            mgr.pool.give_back(own)
            if mgr.on_blocks_removed is not None:
                mgr.on_blocks_removed(own)
        t += k
        kb = kb[k * bb:]
        parent = top
    if t < nfull:
        node = tree.add_child(parent, kb, seq.live_block_ids(t, nfull))
        if mgr._kv is not None:
            mgr._kv.stored(seq._seq_id, seq._tokens, seq._scope, t,
                           seq.live_block_ids(t, nfull))
        mgr.pool.hold_new(node, seq._priority)
        parent = node
    seq._last = parent
    seq._tree_blocks = nfull


def _adopt(mgr: KVCacheManager, deep: Node, own: list[int]) -> None:
    """Move the host edges from `deep` up to the first device edge back to the
    device, onto the last of `own` (the committing sequence's blocks, which hold the
    same KV): no copy, their slots are freed; the sequence then holds them as its own
    (`take_path` switches nothing there)."""
    host = mgr._host
    assert host is not None
    chain: list[Node] = []
    node: Node | None = deep
    while node is not None and node.host:
        chain.append(node)
        node = node.parent
    at = len(own) - sum(len(n.blocks) for n in chain)
    for node in reversed(chain):
        k = len(node.blocks)
        host.num_droppable -= k
        host.move_to_device(node, own[at:at + k])
        mgr.pool.num_evictable += k  # an unreferenced device edge, until acquired
        at += k


def cache_tail(mgr: KVCacheManager, seq: Sequence) -> bool:
    """Cache the committed partial tail of freed `seq` as a partial leaf, unless a cached
    block already starts with it; returns whether it did (its block then stays)."""
    n = seq._committed
    start = n - n % mgr._B
    tail = seq._tokens[start:n].tobytes()
    parent = seq._last if seq._last is not None else mgr.tree.root(seq._scope)
    for c in parent.children.get(tail[:TOKEN_BYTES], ()):
        if c.key.startswith(tail):
            return False
    block = seq._block_ids[start // mgr._B]
    assert block is not None  # the window always reaches the block of the next token
    node = mgr.tree.add_child(parent, tail, [block])
    if mgr._kv is not None:
        mgr._kv.stored_partial(seq._seq_id, seq._tokens, seq._scope, start // mgr._B,
                               n - start, block)
    mgr.pool.add_cached(node, seq._priority)
    return True
