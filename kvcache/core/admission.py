"""Admission: a prompt's plan (one walk of the tree), and carrying it out.

`make_plan` is the work of `KvCacheManager.plan_admission`, `match_reuse` and
`probe_reuse`: the walk, the reuse alignment, the sliding-window cut and the pressure
claim, changing nothing. `carry_out` is `admit`'s once the manager has checked the call,
in four steps: hold the hits (`_hold_hits`), take the partial block (`_claim` it, or
hold it as a copy source), allocate and onboard (`CacheState.allocate`, `_onboard`,
then `_copy_partial`), and count (`_count`). Only the manager calls these, after
checking the call; each takes its `CacheState` explicitly.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable

from kvcache.core.events import CacheEvent
from kvcache.core.handle import SequenceHandle, SequenceRecord
from kvcache.core.keys import TOKEN_BYTES, ScopeKey
from kvcache.core.ops import BlockCopy, BlockOnboard
from kvcache.core.plan import AdmissionPlan
from kvcache.core.pool import Allocation
from kvcache.core.radix import Node, PartialHit
from kvcache.core.state import CacheState
from kvcache.core.window_holds import (
    Hits,
    cut_hits,
    cut_to_window,
    held_ids,
    segment_stop,
    unheld_below,
)


def make_plan(state: CacheState, tokens: array, key_bytes: bytes, scope: ScopeKey,
              first_chunk: int | None = None, injected_fault: bool = False) -> AdmissionPlan:
    """The admission plan of token array `tokens` (bytes `key_bytes`) in scope `scope`
    now, `injected_fault` as the fault-injection seam decided. Pure: changes nothing.

    Under a sliding window with a `first_chunk`, only that chunk's blocks are needed
    now (None: every prompt block).
    """
    length = len(tokens)
    root = state.tree.roots.get(scope) if state.reuse and length > 1 else None
    if root is None or not root.children:
        return _plan(state, tokens, scope, first_chunk, injected_fault, [], 0, None, 0)
    hits, num_full, partial, num_cached = state.tree.match(
        root, key_bytes, (length - 1) * TOKEN_BYTES, state.partial_reuse,
        state.copy_on_partial)
    if num_full % state.alignment_blocks:  # alignment rules partial reuse out
        num_full -= num_full % state.alignment_blocks
        hits = cut_hits(hits, num_full)
        partial, num_cached = None, num_full * state.tokens_per_block
    return _plan(state, tokens, scope, first_chunk, injected_fault, hits, num_full, partial,
                 num_cached)


def _plan(state: CacheState, tokens: array, scope: ScopeKey, first_chunk: int | None,
          injected_fault: bool, hits: Hits, num_full_blocks: int,
          partial_hit: PartialHit | None, num_cached_tokens: int) -> AdmissionPlan:
    """The plan of a match (`hits`: `num_full_blocks` full blocks, then `partial_hit`,
    `num_cached_tokens` tokens in all): cut to the window, with what it holds and
    needs. Pure.

    When protecting an unreferenced copy source would take the very block the
    admission needs, the admission takes every available block either way: it claims
    the source instead, evicting what follows it. A prompt that fits is never refused;
    the partial hit is forgone only by a plan that does not fit.
    """
    pool = state.pool
    block_size = state.tokens_per_block
    num_blocks = (len(tokens) + block_size - 1) // block_size
    num_skipped_blocks = 0
    if state.window_left is not None:  # full attention needs every matched block
        (hits, num_full_blocks, partial_hit, num_cached_tokens,
         num_skipped_blocks) = cut_to_window(hits, num_full_blocks, partial_hit,
                                             state.window_left, block_size,
                                             state.alignment_blocks)
    if num_skipped_blocks:
        hit_block_ids, num_available = held_ids(hits, num_skipped_blocks, pool.num_available)
    else:  # held_ids(hits, 0, ...) inlined: the walk's hot path
        hit_block_ids = []
        num_available = len(pool.free) + pool.num_evictable
        for node, matched in hits:
            blocks = node.blocks
            hit_block_ids += blocks if matched == len(blocks) else blocks[:matched]
            if not node.ref:
                num_available -= matched  # about to be referenced
    num_onboard_blocks = 0
    if state.host is not None:  # a host hit takes a device block, and held none
        num_onboard_blocks = sum(matched for node, matched in hits if node.host)
        num_available += num_onboard_blocks  # of the evictable ones counted off above
    num_new_blocks = num_blocks if first_chunk is None else _end_block(
        state, len(tokens), num_cached_tokens, first_chunk)
    num_new_blocks -= num_full_blocks + (partial_hit is not None and partial_hit.claim)
    need = num_new_blocks + num_onboard_blocks
    if partial_hit is not None and not partial_hit.node.ref and not partial_hit.node.host:
        if partial_hit.claim or need < num_available:
            num_available -= 1  # claimed, or a copy source protected during the admission
        elif need == num_available and (state.window_left is None
                                        or unheld_below(partial_hit.node)):
            # a copy does not fit: claim the source (see above); under a window the
            # blocks below an unreferenced node may still be held, and then it cannot
            partial_hit = PartialHit(partial_hit.node, partial_hit.at, partial_hit.num_tokens,
                                     claim=True)
            num_new_blocks -= 1
            num_available -= 1
        else:  # forgo the partial hit: under a window, the match then reaches further
            return _plan(state, tokens, scope, first_chunk, injected_fault, hits,
                         num_full_blocks, None, num_full_blocks * block_size)
    return AdmissionPlan(
        cache=state, version=state.version, tokens=tokens, scope=scope,
        num_blocks=num_blocks, hits=hits, hit_block_ids=hit_block_ids,
        num_full_blocks=num_full_blocks, partial_hit=partial_hit,
        num_cached_tokens=num_cached_tokens, num_new_blocks=num_new_blocks,
        num_available=num_available, num_skipped_blocks=num_skipped_blocks,
        num_onboard_blocks=num_onboard_blocks, injected_fault=injected_fault)


def _end_block(state: CacheState, length: int, num_cached: int,
              first_chunk: int | None) -> int:
    """Blocks an admission of `length` tokens covers: every prompt block, or under a
    sliding window with a `first_chunk`, those of the tokens up to the end of that
    chunk (after the `num_cached` reused ones)."""
    block_size = state.tokens_per_block
    if first_chunk is not None and state.window_left is not None:
        length = min(length, num_cached + first_chunk)
    return (length + block_size - 1) // block_size


def carry_out(state: CacheState, seq_id: Hashable, plan: AdmissionPlan,
              priority: int) -> SequenceHandle:
    """Carry out `plan`, already checked (live id, priority, binding, version, fit), for
    a new sequence `seq_id`; returns its handle, registered with its record in the
    state. Mutates the tree, the pools, the op queue, the counters, the records and the
    handles."""
    state.version += 1
    block_ids: list[int | None] = [None] * plan.num_skipped_blocks
    block_ids += plan.hit_block_ids
    deepest, host_chain = _hold_hits(state, plan, priority)
    hit = plan.partial_hit
    followers: list[int] = []
    source = None
    if hit is not None and hit.claim:
        followers = _claim(state, hit.node)
        block_ids.append(hit.node.blocks[0])
    elif hit is not None:
        source = _hold_copy_source(state, hit.node, priority)
    allocation = state.allocate(plan.num_new_blocks - len(followers)
                                + plan.num_onboard_blocks)
    if plan.num_onboard_blocks:  # host hits take the last blocks allocated
        allocation = _onboard(state, plan, allocation, host_chain, block_ids)
    new = allocation.block_ids + followers
    onboarded = plan.num_onboard_blocks
    if source is not None and hit is not None:
        onboarded += _copy_partial(state, seq_id, hit, source, new[0])
    block_ids += new
    record = SequenceRecord(seq_id, plan.tokens, plan.scope, priority, block_ids,
                            plan.num_cached_tokens, deepest, plan.num_full_blocks,
                            plan.num_skipped_blocks)
    _count(state, record, plan, allocation, onboarded)
    state.records[seq_id] = record
    handle = state.handles[seq_id] = SequenceHandle(record)
    if state.events is not None:
        state.events.append(CacheEvent("admit", seq_id, tuple(plan.tokens),
                                       plan.num_cached_tokens, plan.scope, tuple(block_ids),
                                       priority))
    return handle


def _hold_hits(state: CacheState, plan: AdmissionPlan,
               priority: int) -> tuple[Node | None, list[Node]]:
    """Reference the plan's matched path for the new sequence, split where the match
    ends; returns its deepest node and the host edges among the hits, pinned top-down
    until `_onboard` moves them."""
    if not plan.hits:
        return None, []
    pool = state.pool
    last, matched = plan.hits[-1]
    deepest = pool.split(last, matched) if matched < len(last.blocks) else last
    if plan.num_onboard_blocks:
        # Host edges have no holders, so they are pinned, and the device edges above
        # held as usual. (A host tier is refused with a sliding window: nothing skipped.)
        host = state.host
        assert host is not None  # host hits come from a host tier
        chain = host.pin_chain(deepest, priority)
        above = chain[0].parent
        if above is not None and above.parent is not None:
            pool.acquire(above, None, priority)
        return deepest, chain
    skipped = plan.num_skipped_blocks  # a window's: only the segment from there is held
    stop = segment_stop(pool, deepest, plan.num_full_blocks, skipped) if skipped else None
    pool.acquire(deepest, stop, priority)
    return deepest, []


def _claim(state: CacheState, node: Node) -> list[int]:
    """Take the partially matched unused leaf `node` (split by `_hold_hits` to start at
    that block) out of the tree for the new sequence, evicting what follows its first
    block when a copy did not fit (`_plan`). Returns the ids of those followers: they
    serve as the admission's new blocks."""
    pool = state.pool
    followers: list[int] = []
    if node.children or len(node.blocks) > 1:
        followers = pool.evict_below(node)
        state.removed(followers)
    pool.forget_cached(node)
    state.tree.prune(node)
    state.removed(node.blocks)
    return followers


def _hold_copy_source(state: CacheState, node: Node, priority: int) -> Node:
    """Hold the partially matched block of `node` (split off as an edge of its own) so
    that no eviction of this admission takes it before its copy is queued; returns it."""
    source = state.pool.split(node, 1) if len(node.blocks) > 1 else node
    if source.host:  # host edges have no holders: pinned (as in _hold_hits)
        assert state.host is not None
        state.host.pin(source, priority)
    else:
        state.pool.acquire(source, source.parent, priority)
    return source


def _onboard(state: CacheState, plan: AdmissionPlan, allocation: Allocation,
             host_chain: list[Node], block_ids: list[int | None]) -> Allocation:
    """Move the pinned `host_chain` (the plan's host hits) onto the last blocks of the
    admission's `allocation`, one device block each; their ids take their positions in
    `block_ids`. Returns the allocation less those blocks."""
    onboard = plan.num_onboard_blocks
    assert state.host is not None  # host hits come from a host tier
    new = allocation.block_ids
    own = len(new) - onboard
    full = plan.num_full_blocks
    block_ids[full - onboard:full] = state.host.onboard(host_chain, new[own:])
    return Allocation(new[:own], min(allocation.num_fresh, own), allocation.num_offloaded,
                      allocation.num_dropped)


def _copy_partial(state: CacheState, seq_id: Hashable, hit: PartialHit, source: Node,
                  target: int) -> int:
    """Queue the copy of the partial hit's tokens from the held `source` into the new
    sequence's block `target`, and let go of the source. Returns how many blocks that
    onboards: 1 from a host block (which is pinned, not held), else 0. The source is
    released a tick after the last free: it was used after every block released so far,
    so least recently released goes by that, not by the heap's push order."""
    state.pool.tick()
    if source.host:  # the KV is in a host slot: onboarded, and the pin dropped
        host = state.host
        assert host is not None
        state.queue(seq_id, BlockOnboard(source.blocks[0], target, hit.num_tokens))
        host.num_onboarded += 1
        host.unpin(source, state.pool.clock)
        return 1
    state.queue(seq_id, BlockCopy(source.blocks[0], target, hit.num_tokens))
    state.pool.release(source, source.parent)
    return 0


def _count(state: CacheState, record: SequenceRecord, plan: AdmissionPlan,
           allocation: Allocation, onboarded: int) -> None:
    """Count the admission in the new sequence's metrics and the cache's counters."""
    partial = plan.partial_hit is not None
    missed = plan.num_blocks - plan.num_full_blocks - partial
    record.num_full_reused_blocks = plan.num_full_blocks
    record.num_partial_reused_blocks = int(partial)
    record.num_missed_blocks = missed
    record.num_total_allocated_blocks = plan.num_new_blocks
    record.num_new_allocated_blocks = allocation.num_fresh
    record.num_onboarded_blocks = onboarded
    record.num_offloaded_blocks = allocation.num_offloaded
    record.num_dropped_blocks = allocation.num_dropped
    counters = state.counters
    counters.full_reused_blocks += plan.num_full_blocks
    counters.partial_reused_blocks += partial
    counters.missed_blocks += missed
    counters.alloc_total_blocks += plan.num_new_blocks
    counters.alloc_new_blocks += allocation.num_fresh
    counters.reused_tokens += plan.num_cached_tokens
    if plan.partial_hit is not None:
        if plan.partial_hit.claim:
            counters.claimed_blocks += 1
        else:
            counters.copied_blocks += 1
