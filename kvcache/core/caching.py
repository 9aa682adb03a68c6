"""Caching a sequence's KV in the tree: its committed full blocks, and its partial tail.

`_cache_full_blocks` is the tree side of `KVCacheManager.commit`: blocks equal to ones
already cached are deduplicated (the sequence switches to them), the rest become an edge
the sequence holds. `_cache_tail` runs at `free_sequence` with partial reuse on. A base
class of KVCacheManager over its state (state.py); only the manager calls these.
"""

from __future__ import annotations

from kvcache.core.handle import Sequence
from kvcache.core.keys import TOKEN_BYTES
from kvcache.core.radix import Node
from kvcache.core.state import CacheState
from kvcache.core.window_holds import take_path


class Caching(CacheState):
    """The caching side of the manager: committed blocks and tails into the tree."""

    def _cache_full_blocks(self, seq: Sequence, nfull: int) -> None:
        """Put the committed full blocks of `seq` from its `tree_blocks` up to `nfull` into
        the tree: a leaf only it holds, at its priority, grows in place; otherwise blocks equal to cached ones
        switch to those (its own go back to the pool, `block_ids_version` is bumped; a host
        copy takes its blocks instead) and the rest become a new edge it holds."""
        B = self._B
        t = seq._tree_blocks
        deep = seq._last
        tree = self.tree
        if (deep is not None and deep.ref == 1 and not deep.children
                and deep.priority == seq._priority):
            # a leaf only this sequence holds: grow it in place, the tree stays compressed
            # (not when a holder gone since raised its priority: the new blocks have only
            # this sequence's, so they become an edge of their own)
            tree.extend_leaf(deep, seq._tokens[t * B:nfull * B].tobytes(),
                             seq.live_block_ids(t, nfull))
            if self._kv is not None:
                self._kv.stored(seq._seq_id, seq._tokens, seq._scope, t,
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
            top = self.pool.split(last, nb) if nb * bb < len(last.key) else last
            if top.host:  # those on the host take this sequence's own blocks, no copy
                self._adopt(top, seq.live_block_ids(t, t + k))
            self.pool.acquire(top, parent, seq._priority)
            own = take_path(seq, [*(n for n, _ in hits[:-1]), top], t, bb, self._kv)
            if own:
                seq._block_ids_version += 1
                self.pool.give_back(own)
                if self.on_blocks_removed is not None:
                    self.on_blocks_removed(own)
            t += k
            kb = kb[k * bb:]
            parent = top
        if t < nfull:
            node = tree.add_child(parent, kb, seq.live_block_ids(t, nfull))
            if self._kv is not None:
                self._kv.stored(seq._seq_id, seq._tokens, seq._scope, t,
                               seq.live_block_ids(t, nfull))
            self.pool.hold_new(node, seq._priority)
            parent = node
        seq._last = parent
        seq._tree_blocks = nfull


    def _adopt(self, deep: Node, own: list[int]) -> None:
        """Move the host edges from `deep` up to the first device edge back to the
        device, onto the last of `own` (the committing sequence's blocks, which hold the
        same KV): no copy, their slots are freed; the sequence then holds them as its own
        (`take_path` switches nothing there)."""
        host = self._host
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
            self.pool.num_evictable += k  # an unreferenced device edge, until acquired
            at += k


    def _cache_tail(self, seq: Sequence) -> bool:
        """Cache the committed partial tail of freed `seq` as a partial leaf, unless a cached
        block already starts with it; returns whether it did (its block then stays)."""
        n = seq._committed
        start = n - n % self._B
        tail = seq._tokens[start:n].tobytes()
        parent = seq._last if seq._last is not None else self.tree.root(seq._scope)
        for c in parent.children.get(tail[:TOKEN_BYTES], ()):
            if c.key.startswith(tail):
                return False
        block = seq._block_ids[start // self._B]
        assert block is not None  # the window always reaches the block of the next token
        node = self.tree.add_child(parent, tail, [block])
        if self._kv is not None:
            self._kv.stored_partial(seq._seq_id, seq._tokens, seq._scope, start // self._B,
                                   n - start, block)
        self.pool.add_cached(node, seq._priority)
        return True
