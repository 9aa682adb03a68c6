"""Caching a sequence's KV in the tree: its committed full blocks, and its partial tail.

`cache_full_blocks` is the tree side of `KvCacheManager.commit`: a leaf only the
sequence holds grows in place; otherwise blocks equal to ones already cached are
deduplicated (`_switch_to_cached`: the sequence switches to them) and the rest become an
edge the sequence holds. `cache_tail` runs at `free_sequence` with partial reuse on.
Only the manager calls these, after checking the call; each takes its `CacheState`
explicitly and changes the tree, the pool and the sequence's record.
"""

from __future__ import annotations

from kvcache.core.handle import SequenceRecord
from kvcache.core.keys import TOKEN_BYTES
from kvcache.core.kv_event_log import KvEventLog
from kvcache.core.radix import Node
from kvcache.core.state import CacheState
from kvcache.core.window_holds import take_path


def cache_full_blocks(state: CacheState, record: SequenceRecord, num_full: int) -> None:
    """Put the committed full blocks of `record` from its `num_tree_blocks` up to
    `num_full` into the tree: a leaf only it holds, at its priority, grows in place;
    otherwise blocks equal to cached ones switch to those (its own go back to the pool,
    `block_ids_version` is bumped; a host copy takes its blocks instead) and the rest
    become a new edge it holds."""
    block_size = state.tokens_per_block
    start = record.num_tree_blocks
    deepest = record.last_node
    key_bytes = record.tokens[start * block_size:num_full * block_size].tobytes()
    if (deepest is not None and deepest.ref == 1 and not deepest.children
            and deepest.priority == record.priority):
        # a leaf only this sequence holds: grow it in place, the tree stays compressed
        # (not when a holder gone since raised its priority: the new blocks have only
        # this sequence's, so they become an edge of their own)
        state.tree.extend_leaf(deepest, key_bytes, record.live_block_ids(start, num_full))
        if state.kv_event_log is not None:
            _stored(state.kv_event_log, record, start, num_full)
        record.num_tree_blocks = num_full
        return
    parent = deepest if deepest is not None else state.tree.root(record.scope)
    parent, start, key_bytes = _switch_to_cached(state, record, parent, start, key_bytes)
    if start < num_full:
        node = state.tree.add_child(parent, key_bytes, record.live_block_ids(start, num_full))
        if state.kv_event_log is not None:
            _stored(state.kv_event_log, record, start, num_full)
        state.pool.hold_new(node, record.priority)
        parent = node
    record.last_node = parent
    record.num_tree_blocks = num_full


def _stored(log: KvEventLog, record: SequenceRecord, start: int, end: int) -> None:
    """Log blocks [start, end) of `record` entering the tree."""
    log.stored(record.seq_id, record.tokens, record.scope, start,
               record.live_block_ids(start, end))


def _switch_to_cached(state: CacheState, record: SequenceRecord, parent: Node, start: int,
                      key_bytes: bytes) -> tuple[Node, int, bytes]:
    """Deduplicate the leading blocks of `key_bytes` (blocks `start`.. of `record`)
    against equal cached ones below `parent`: the sequence holds those and switches to
    their blocks, giving its own back. Returns the node to hang the rest from, the
    first position not switched and the key bytes from there (`parent`, `start` and
    `key_bytes` themselves when nothing equal is cached)."""
    tree = state.tree
    block_bytes = tree.block_bytes
    first = parent.full.get(key_bytes[:block_bytes])
    if first is None:
        return parent, start, key_bytes
    if len(key_bytes) == block_bytes:  # one block (a decode step's): the index matched it
        hits, matched = [(first, 1)], 1
    else:
        match = tree.match(parent, key_bytes, len(key_bytes), False, False)
        hits, matched = match.hits, match.num_full_blocks
    last, last_matched = hits[-1]
    top = last
    if last_matched * block_bytes < len(last.key):
        top = state.pool.split(last, last_matched)
    if top.host:  # host edges have no device blocks: they take the sequence's, no copy
        _adopt(state, top, record.live_block_ids(start, start + matched))
    state.pool.acquire(top, parent, record.priority)
    own = take_path(record, [*(node for node, _ in hits[:-1]), top], start, block_bytes,
                    state.kv_event_log)
    if own:
        record.block_ids_version += 1
        state.pool.give_back(own)
        for listener in state.listeners:  # not the KV event log: these were never cached
            listener.removed(own)
    return top, start + matched, key_bytes[matched * block_bytes:]


def _adopt(state: CacheState, deepest: Node, own: list[int]) -> None:
    """Move the host edges from `deepest` up to the first device edge back to the
    device, onto the last of `own` (the committing sequence's blocks, which hold the
    same KV): no copy, their slots are freed; the sequence then holds them as its own
    (`take_path` switches nothing there)."""
    host = state.host
    assert host is not None  # host edges come from a host tier
    chain: list[Node] = []
    node: Node | None = deepest
    while node is not None and node.host:
        chain.append(node)
        node = node.parent
    at = len(own) - sum(len(edge.blocks) for edge in chain)
    for edge in reversed(chain):
        count = len(edge.blocks)
        host.num_droppable -= count
        host.move_to_device(edge, own[at:at + count])
        state.pool.num_evictable += count  # an unreferenced device edge, until acquired
        at += count


def cache_tail(state: CacheState, record: SequenceRecord) -> bool:
    """Cache the committed partial tail of freed `record` as a partial leaf, unless a
    cached block already starts with it; returns whether it did (its block then stays)."""
    committed = record.num_committed_tokens
    block_size = state.tokens_per_block
    start = committed - committed % block_size
    tail = record.tokens[start:committed].tobytes()
    last = record.last_node
    parent = last if last is not None else state.tree.root(record.scope)
    for child in parent.children.get(tail[:TOKEN_BYTES], ()):
        if child.key.startswith(tail):
            return False
    block = record.block_ids[start // block_size]
    assert block is not None  # the window always reaches the block of the next token
    node = state.tree.add_child(parent, tail, [block])
    if state.kv_event_log is not None:
        state.kv_event_log.stored_partial(record.seq_id, record.tokens, record.scope,
                                          start // block_size, committed - start, block)
    state.pool.add_cached(node, record.priority)
    return True
