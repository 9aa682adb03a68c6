"""KVCacheManager: admit sequences with reuse, commit, append, free, probe, stats.

The manager touches no tensors: it hands out block ids and ops (`BlockCopy`, and with a
host tier `BlockOffload` and `BlockOnboard`) that the engine applies to storage, in queue
order, before its next forward pass. It changes the tree and the pools only through their
methods. Every public mutator either succeeds or raises before changing anything (bad
input: ValueError; no room: OutOfBlocksError). Admission is one walk:
`plan_admission` works out what a prompt would reuse and need, `admit` carries it out.

With `KvCacheConfig.sliding_window` set, a sequence holds only the blocks some later
token's window can reach (kvcache/core/window.py): `commit` releases the rest, prompt
blocks are allocated as the engine reserves them chunk by chunk, and a match needs only
the cached blocks inside the window of its first new token.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq

from kvcache.core.config import KvCacheConfig
from kvcache.core.events import CacheEvent, op_event
from kvcache.core.handle import Sequence
from kvcache.core.host_tier import HostTier
from kvcache.core.integrity import check_manager
from kvcache.core.kv_event_log import KvEventLog
from kvcache.core.kv_events import KvCacheEvent
from kvcache.core.ops import CACHE, BlockCopy, BlockOnboard, KvOp
from kvcache.core.plan import AdmissionPlan, ReuseMatch
from kvcache.core.pool import BlockPool, OutOfBlocksError
from kvcache.core.radix import (
    TOKEN_BYTES,
    BlockRadixTree,
    Node,
    ReuseScope,
    ScopeKey,
    scope_key,
    to_token_array,
    token_bytes,
)
from kvcache.core.stats import KvCacheStats
from kvcache.core.validate import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    check_int,
    check_positive_int,
    check_priority,
)
from kvcache.core.window import first_held_block
from kvcache.core.window_holds import (
    cut_hits,
    cut_to_window,
    held_ids,
    release_front,
    segment_stop,
    take_path,
    unheld_below,
)

DEFAULT_PRIORITY = 35


def _unknown(where: str, seq_id: Hashable) -> ValueError:
    return ValueError(f"{where}: unknown seq_id {seq_id!r} (not admitted, or freed)")


class _Counters:
    """Cumulative counters, kept as plain attributes for the hot path."""

    __slots__ = ("alloc_new", "alloc_total", "claimed", "copied", "decode_alloc", "full_reused",
                 "missed", "partial_reused", "reused_tokens")

    def __init__(self) -> None:
        self.alloc_total = self.alloc_new = self.full_reused = self.partial_reused = 0
        self.missed = self.reused_tokens = self.decode_alloc = self.copied = self.claimed = 0


class KVCacheManager:
    """A paged KV cache's bookkeeping: a block radix tree over a fixed block pool."""

    def __init__(self, config: KvCacheConfig, *, record_events: bool = False,
                 kv_events: bool = False) -> None:
        if not isinstance(config, KvCacheConfig):
            raise ValueError(f"KVCacheManager: expected a KvCacheConfig, got {config!r}")
        self.config = config
        self._B = config.tokens_per_block
        # window_left of the sliding window the cache exploits (None: full attention)
        self._wl = None if config.sliding_window is None else config.sliding_window - 1
        self.tree = BlockRadixTree(self._B)
        self.pool = BlockPool(config.max_num_blocks, self.tree, windowed=self._wl is not None)
        # KV-cache events for routers (blocks stored and removed), see kv_events.py
        self._kv = KvEventLog(self._B) if kv_events else None
        # the host tier (TensorRT-LLM's secondary pool; never with a window), host_tier.py
        self._host: HostTier | None = None
        if config.host_cache_blocks:
            self._host = self.pool.host = HostTier(config.host_cache_blocks, self.pool,
                                                   self._queue, self._kv)
        self.reuse = config.block_reuse
        self._partial = config.partial_reuse
        self._copy = config.copy_on_partial
        self._align = config.reuse_alignment_blocks
        self.sequences: dict[Hashable, Sequence] = {}
        # (owner, op): a sequence's copies die with it; CACHE's moves of tree blocks never
        self._copy_ops: list[tuple[Hashable, KvOp]] = []
        self._c = _Counters()
        self._step_base: KvCacheStats | None = None
        self._version = 0  # bumped by every mutation: plans made before it are stale
        self.events: list[CacheEvent] | None = [] if record_events else None
        # Told the ids of cached blocks that left the tree (evicted, or claimed by an
        # admission), and of a sequence's own blocks given back when its commit switched
        # to equal cached ones, after the fact: the engine drops what it keeps per block.
        self.on_blocks_removed: Callable[[list[int]], None] | None = None
        # Test seam for fault injection: called as (operation, blocks needed) before any
        # allocation; returning True refuses it (a plan that does not fit, or
        # OutOfBlocksError from append_tokens), nothing changed.
        self.allocation_fault: Callable[[str, int], bool] | None = None

    # ------------------------------------------------------------------ admission
    def plan_admission(self, tokens: Seq[int], scope: ReuseScope | None = None, *,
                       first_chunk: int | None = None) -> AdmissionPlan:
        """What admitting `tokens` in `scope` would reuse and need now. Changes nothing.

        Pass the plan to `admit` before the cache changes again. A plan that does not
        fit says so (`fits` is False); it is not an error. Under a sliding window,
        `first_chunk` caps the tokens the first step computes: only their blocks are
        allocated, later ones come from `reserve` (None: the whole prompt's, as always
        under full attention). Raises ValueError for an empty prompt, bad tokens, a bad
        scope or a `first_chunk` that is not a positive int.
        """
        skey = None if scope is None else scope_key(scope, "plan_admission")
        arr, kb = token_bytes(tokens, "plan_admission", None)
        if not arr:
            raise ValueError("plan_admission: empty prompt")
        if first_chunk is not None:
            first_chunk = check_positive_int(first_chunk, "plan_admission: first_chunk")
        plan = self._plan(arr, kb, skey, first_chunk)
        fault = self.allocation_fault
        if fault is not None and fault("add_sequence", plan.num_blocks):
            plan._fault = True
        return plan

    def admit(self, seq_id: Hashable, plan: AdmissionPlan,
              priority: int = DEFAULT_PRIORITY) -> Sequence:
        """Carry out `plan` for a new sequence `seq_id`; returns its live `Sequence`.

        `num_cached_tokens` tokens (any alignment) need no compute. A partial hit on an
        unused leaf claims that block (it leaves the tree); otherwise it queues a
        `BlockCopy` for `take_copy_ops()` (a `BlockOnboard` from a host block). Full
        blocks reused from the host tier are onboarded: device blocks are allocated for
        them, with the admission's own, and a `BlockOnboard` is queued for each; the
        evictions that allocation makes queue their offloads first. Raises ValueError for
        a live `seq_id`, a bad priority or a stale plan (the cache changed since it was
        made), and OutOfBlocksError for a plan that does not fit; either way nothing
        changes.
        """
        if seq_id in self.sequences:
            raise ValueError(f"admit({seq_id!r}): seq_id is already live")
        # the checks format their messages only on failure: an f-string per call would
        # cost as much as the rest of the checks
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            priority = check_priority(priority, f"admit({seq_id!r})")
        if plan._version != self._version:
            raise ValueError(f"admit({seq_id!r}): stale plan: the cache changed after "
                             "plan_admission; plan again")
        pool = self.pool
        if plan._need + plan._onboard > plan._available or plan._fault:  # not plan.fits
            fault = " [injected fault]" if plan._fault else ""
            raise OutOfBlocksError(f"add_sequence({seq_id!r}){fault}",
                                   plan._need + plan._onboard,
                                   0 if plan._fault else plan._available, pool.num_blocks)
        self._version += 1
        hits, ph, need, first = plan._hits, plan._partial, plan._need, plan._first
        ids: list[int | None] = [None] * first
        ids += plan._block_ids
        onboard = plan._onboard
        tree = self.tree
        host = self._host
        deep = None
        chain: list[Node] = []  # the host edges it reuses, pinned until onboarded
        if hits:
            last, nb = hits[-1]
            deep = pool.split(last, nb) if nb < len(last.blocks) else last
            if onboard and host is not None:
                chain = host.pin_chain(deep, priority)
                above = chain[0].parent
                if above is not None and above.parent is not None:
                    pool.acquire(above, None, priority)
            else:
                stop = segment_stop(pool, deep, plan._full, first) if first else None
                pool.acquire(deep, stop, priority)
        src = None
        followers: list[int] = []
        if ph is not None:
            node = ph.node  # after the split above it starts at the candidate block
            if ph.claim:
                if node.children or len(node.blocks) > 1:  # see _plan: a copy did not fit
                    followers = pool.evict_below(node)
                    self._removed(followers)
                pool.forget_cached(node)
                tree.prune(node)
                self._removed(node.blocks)
                ids.append(node.blocks[0])
            else:
                src = pool.split(node, 1) if len(node.blocks) > 1 else node
                if src.host and host is not None:
                    host.pin(src, priority)
                else:
                    pool.acquire(src, src.parent, priority)
        moved = (host.num_offloaded, host.num_dropped) if host is not None else (0, 0)
        new, fresh = pool.allocate(need - len(followers) + onboard)
        if fresh < len(new):
            self._removed(new[fresh:])
        if chain and host is not None:  # the host slots of its hits become device blocks
            ids[plan._full - onboard:plan._full] = host.onboard(chain, new[len(new) - onboard:])
            del new[len(new) - onboard:]
        new += followers
        if src is not None and ph is not None:
            if src.host and host is not None:
                self._copy_ops.append((seq_id, BlockOnboard(src.blocks[0], new[0],
                                                            ph.num_tokens)))
                host.num_onboarded += 1
                onboard += 1
                host.unpin(src, pool.clock)
            else:
                self._copy_ops.append((seq_id, BlockCopy(src.blocks[0], new[0],
                                                         ph.num_tokens)))
                pool.release(src, src.parent)
        ids += new
        nfull, cached = plan._full, plan._cached
        seq = Sequence(seq_id, plan._tokens, plan._scope, priority, ids, cached, deep, nfull,
                       first)
        if host is not None:
            seq._onboarded = onboard
            seq._offloaded = host.num_offloaded - moved[0]
            seq._dropped = host.num_dropped - moved[1]
        # its metrics and the counters (inlined: this runs once per request)
        partial = ph is not None
        missed = plan._num_blocks - nfull - partial
        fresh = min(fresh, need - len(followers))
        seq._full_reused, seq._partial_reused, seq._missed = nfull, int(partial), missed
        seq._alloc_total, seq._alloc_new = need, fresh
        c = self._c
        c.full_reused += nfull
        c.partial_reused += partial
        c.missed += missed
        c.alloc_total += need
        c.alloc_new += fresh
        c.reused_tokens += cached
        if ph is not None:
            if ph.claim:
                c.claimed += 1
            else:
                c.copied += 1
        self.sequences[seq_id] = seq
        if self.events is not None:
            self.events.append(CacheEvent("admit", seq_id, tuple(seq._tokens), cached,
                                          seq._scope, tuple(ids)))
        return seq

    def add_sequence(self, seq_id: Hashable, tokens: Seq[int], scope: ReuseScope | None = None,
                     priority: int = DEFAULT_PRIORITY) -> Sequence:
        """Plan and admit in one call (see `plan_admission` and `admit`).

        Raises ValueError for a live `seq_id`, an empty prompt, bad tokens, scope or
        priority, and OutOfBlocksError when the blocks cannot be had; either way nothing
        changes.
        """
        if seq_id in self.sequences:
            raise ValueError(f"add_sequence({seq_id!r}): seq_id is already live")
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            priority = check_priority(priority, f"add_sequence({seq_id!r})")
        skey = None if scope is None else scope_key(scope, f"add_sequence({seq_id!r})")
        arr, kb = token_bytes(tokens, "add_sequence", seq_id)
        if not arr:
            raise ValueError(f"add_sequence({seq_id!r}): empty prompt")
        plan = self._plan(arr, kb, skey)
        fault = self.allocation_fault
        if fault is not None and fault("add_sequence", plan._num_blocks):
            plan._fault = True
        return self.admit(seq_id, plan, priority)

    def _plan(self, arr: array, kb: bytes, skey: ScopeKey, first_chunk: int | None = None
              ) -> AdmissionPlan:
        """The admission plan of token array `arr` (bytes `kb`) in scope `skey` now. Pure.

        When protecting an unreferenced copy source would take the very block the
        admission needs, the admission takes every available block either way: it claims
        the source instead, evicting what follows it. A prompt that fits is never refused;
        the partial hit is forgone only by a plan that does not fit.
        """
        length = len(arr)
        nblocks = (length + self._B - 1) // self._B
        pool = self.pool
        root = self.tree.roots.get(skey) if self.reuse and length > 1 else None
        if root is None or not root.children:
            need = nblocks if first_chunk is None else self._end_block(length, 0, first_chunk)
            return AdmissionPlan(arr, skey, self._version, nblocks, [], 0, None, 0, need,
                                 pool.num_available, [])
        hits, nfull, ph, ntok = self.tree.match(root, kb, (length - 1) * TOKEN_BYTES,
                                                self._partial, self._copy)
        if nfull % self._align:
            hits, nfull, ntok = self._aligned(hits, nfull)
            ph = None  # alignment rules partial reuse out
        first = 0
        if self._wl is not None:
            hits, nfull, ph, ntok, first = cut_to_window(hits, nfull, ph, self._wl, self._B,
                                                         self._align)
        if first:
            ids, avail = held_ids(hits, first, pool.num_available)
        else:  # held_ids(hits, 0, ...) inlined: the walk's hot path
            ids = []
            avail = len(pool.free) + pool.num_evictable
            for node, nb in hits:
                ids += node.blocks if nb == len(node.blocks) else node.blocks[:nb]
                if not node.ref:
                    avail -= nb  # about to be referenced
        onboard = 0
        if self._host is not None:  # (never windowed: first is 0)
            onboard = sum(nb for node, nb in hits if node.host)  # a device block each,
            avail += onboard  # and none of the evictable ones held_ids counted off
        need = (nblocks if first_chunk is None else self._end_block(length, ntok, first_chunk)
                ) - nfull - (ph is not None and ph.claim)
        if ph is not None and not ph.node.ref and not ph.node.host:
            if ph.claim or need + onboard < avail:
                avail -= 1  # claimed, or a copy source protected during the admission
            elif need + onboard == avail and (self._wl is None or unheld_below(ph.node)):
                # a copy does not fit: claim the source (see above); under a window the
                # blocks below an unreferenced node may still be held, and then it cannot
                ph = ph._replace(claim=True)
                need -= 1
                avail -= 1
            else:
                ph, ntok = None, nfull * self._B
                if self._wl is not None:  # without the partial block the window reaches further
                    hits, nfull, ph, ntok, first = cut_to_window(hits, nfull, None, self._wl,
                                                                 self._B, self._align)
                    ids, avail = held_ids(hits, first, pool.num_available)
                need = self._end_block(length, ntok, first_chunk) - nfull
        return AdmissionPlan(arr, skey, self._version, nblocks, hits, nfull, ph, ntok, need,
                             avail, ids, first_block=first, num_onboard_blocks=onboard)

    def _queue(self, owner: Hashable, op: KvOp) -> None:
        self._copy_ops.append((owner, op))

    def _end_block(self, length: int, num_cached: int, first_chunk: int | None) -> int:
        """Blocks an admission covers: every prompt block, or under a sliding window with
        a `first_chunk`, those of the tokens up to the end of that chunk."""
        if first_chunk is None or self._wl is None:
            return (length + self._B - 1) // self._B
        return (min(length, num_cached + first_chunk) + self._B - 1) // self._B

    def _removed(self, block_ids: list[int]) -> None:
        if self._kv is not None:
            self._kv.removed(block_ids)
        if self.on_blocks_removed is not None:
            self.on_blocks_removed(block_ids)

    def _aligned(self, hits: list[tuple[Node, int]], nfull: int
                 ) -> tuple[list[tuple[Node, int]], int, int]:
        """The hits cut back to a multiple of `reuse_alignment_blocks` full blocks (the
        blocks whose recurrent-state snapshot a hybrid model can restore from)."""
        keep = nfull - nfull % self._align
        return cut_hits(hits, keep), keep, keep * self._B

    # ------------------------------------------------------------------ progress
    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Mark the KV of tokens [0, num_tokens) valid; its full blocks become reusable.

        A full block equal to one already cached is deduplicated: the sequence switches to
        the cached block and its own returns to the pool, so `block_ids` changes in place
        and `block_ids_version` is bumped (re-read the ids before the next forward pass).
        Committing past the admission says a forward pass ran, so the sequence's queued
        copies ran before it (they are dropped from the queue if the caller never took
        them). Raises ValueError for an unknown `seq_id`, a count beyond the sequence or
        below an earlier commit.
        """
        seq = self.sequences.get(seq_id)
        if seq is None:
            raise _unknown("commit", seq_id)
        n = num_tokens
        if type(n) is not int:
            n = check_int(num_tokens, f"commit({seq_id!r}): num_tokens")
        if n > len(seq._tokens):
            raise ValueError(f"commit({seq_id!r}, {n}): beyond the sequence's "
                             f"{len(seq._tokens)} tokens")
        if n < seq._committed:
            raise ValueError(f"commit({seq_id!r}, {n}): goes backwards; "
                             f"{seq._committed} tokens are already committed")
        self._version += 1
        if self._copy_ops and n > seq._committed:
            self._drop_copies(seq_id)
        seq._committed = n
        nfull = n // self._B
        switched = seq._block_ids_version
        if self.reuse and nfull > seq._tree_blocks:
            self._insert(seq, nfull)
        if self.events is not None:
            ids = tuple(seq._block_ids) if seq._block_ids_version != switched else ()
            self.events.append(CacheEvent("commit", seq_id, (), n, None, ids))
        if self._wl is not None:
            self._slide(seq)

    def _slide(self, seq: Sequence) -> None:
        """Release the blocks no token from `num_committed_tokens` on can see."""
        assert self._wl is not None
        new = first_held_block(seq._committed, self._wl, self._B,
                               seq._tree_blocks if self.reuse else None)
        if new > seq._first:
            release_front(self.pool, seq, new, self.reuse)

    def _insert(self, seq: Sequence, nfull: int) -> None:
        B = self._B
        t = seq._tree_blocks
        deep = seq._last
        tree = self.tree
        if deep is not None and deep.ref == 1 and not deep.children:
            # a leaf only this sequence holds: grow it in place, the tree stays compressed
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

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int:
        """Allocate blocks for tokens [0, num_tokens) of `seq_id`, as many as the pool
        can give; returns how many of those tokens its blocks now cover.

        Under a sliding window prompt blocks are allocated as chunks need them; under
        full attention admission allocated them all and this only checks. Never raises
        for lack of room (the caller computes fewer tokens, or preempts). Raises
        ValueError for an unknown `seq_id` or a count outside [0, tokens of the sequence].
        """
        seq = self._get(seq_id, "reserve")
        n = check_int(num_tokens, f"reserve({seq_id!r}): num_tokens", 0, len(seq._tokens))
        need = (n + self._B - 1) // self._B - len(seq._block_ids)
        if need > 0:
            pool = self.pool
            fault = self.allocation_fault
            take = 0 if fault is not None and fault("reserve", need) else min(
                need, pool.num_available)
            if take:
                self._version += 1
                new, fresh = pool.allocate(take)
                if fresh < take:
                    self._removed(new[fresh:])
                seq._block_ids += new
                seq._alloc_total += take
                seq._alloc_new += fresh
                self._c.alloc_total += take
                self._c.alloc_new += fresh
                if self.events is not None:  # an append of no tokens: blocks ahead
                    self.events.append(CacheEvent("append", seq_id, (), 0, None, tuple(new)))
        return min(n, len(seq._block_ids) * self._B)

    def append_tokens(self, seq_id: Hashable, tokens: Seq[int]) -> None:
        """Append generated tokens, allocating blocks as needed.

        Raises ValueError for bad tokens or an unknown `seq_id`, OutOfBlocksError when the
        new blocks cannot be had; either way nothing changes.
        """
        seq = self._get(seq_id, "append_tokens")
        arr = to_token_array(tokens, "append_tokens", seq_id)
        need = (len(seq._tokens) + len(arr) + self._B - 1) // self._B - len(seq._block_ids)
        if need > 0:
            pool = self.pool
            if self.allocation_fault is not None and self.allocation_fault("append_tokens", need):
                raise OutOfBlocksError(f"append_tokens({seq_id!r}) [injected fault]", need, 0,
                                       pool.num_blocks)
            if need > pool.num_available:
                raise OutOfBlocksError(f"append_tokens({seq_id!r})", need, pool.num_available,
                                       pool.num_blocks)
            self._version += 1
            host = self._host
            moved = (host.num_offloaded, host.num_dropped) if host is not None else (0, 0)
            new, fresh = pool.allocate(need)
            if fresh < need:
                self._removed(new[fresh:])
            if host is not None:
                seq._offloaded += host.num_offloaded - moved[0]
                seq._dropped += host.num_dropped - moved[1]
            seq._block_ids += new
            seq._alloc_total += need
            seq._alloc_new += fresh
            c = self._c
            c.decode_alloc += need
            c.alloc_total += need
            c.alloc_new += fresh
        seq._tokens.extend(arr)
        if self.events is not None:
            added = tuple(seq._block_ids[len(seq._block_ids) - max(need, 0):])
            self.events.append(CacheEvent("append", seq_id, tuple(arr), 0, None, added))

    def free_sequence(self, seq_id: Hashable) -> None:
        """Release a sequence: its committed blocks stay cached, the rest return to the pool.

        With partial reuse on, a committed partial tail is cached as a partial leaf unless
        an existing block already starts with it (with it off, a tail could never be
        matched). A copy of this sequence still queued never ran: it is dropped, and the
        tokens it was to write are not cached (its tail is cached only from written KV).
        """
        seq = self.sequences.get(seq_id)
        if seq is None:
            raise _unknown("free_sequence", seq_id)
        self._version += 1
        del self.sequences[seq_id]
        unwritten = bool(self._copy_ops) and self._drop_copies(seq_id)
        if self._kv is not None:
            self._kv.freed(seq_id)
        if self.events is not None:
            self.events.append(CacheEvent("free", seq_id, (), 0, None))
        pool = self.pool
        pool.tick()
        keep = seq._tree_blocks
        if self.reuse:
            if (self._partial and seq._committed % self._B and not unwritten
                    and self._cache_tail(seq)):
                keep += 1
            last = seq._last
            if last is not None:
                first = seq._first
                pool.release(last, segment_stop(pool, last, seq._tree_blocks, first)
                             if first else None)
        pool.give_back(seq.live_block_ids(keep))

    def _cache_tail(self, seq: Sequence) -> bool:
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

    # ------------------------------------------------------------------ queries
    def match_reuse(self, tokens: Seq[int], scope: ReuseScope | None = None) -> ReuseMatch:
        """What an admission of `tokens` in `scope` would reuse now: block ids and counts.

        The lookup of a scheduler, router or benchmark that does not admit: the admission
        plan's walk (`plan_admission(...).reuse`, claims under pool pressure included), holding
        and changing nothing, not even LRU times or statistics. An empty prompt reuses
        nothing. Raises ValueError for bad tokens or a bad scope.
        """
        skey = None if scope is None else scope_key(scope, "match_reuse")
        arr, kb = token_bytes(tokens, "match_reuse", None)
        if not arr:
            return ReuseMatch((), 0, 0, None)
        return self._plan(arr, kb, skey).reuse

    def probe_reuse(self, tokens: Seq[int], scope: ReuseScope | None = None) -> int:
        """Tokens an admission of `tokens` would reuse now (`match_reuse(...).num_tokens`).
        Holds and changes nothing."""
        arr, kb = token_bytes(tokens, "probe_reuse", None)
        if not arr:
            return 0
        return self._plan(arr, kb, scope_key(scope, "probe_reuse"))._cached

    def _drop_copies(self, seq_id: Hashable) -> bool:
        """Forget the queued copies of `seq_id` (never the moves of cached blocks between
        tiers, owned by CACHE: the tree depends on them); returns whether there were any."""
        kept = [e for e in self._copy_ops if e[0] != seq_id]
        dropped = len(kept) != len(self._copy_ops)
        self._copy_ops = kept
        return dropped

    @property
    def pending_copy_ops(self) -> list[KvOp]:
        """Ops queued and not yet taken (a copy of the queue; read-only view)."""
        return [op for _, op in self._copy_ops]

    @property
    def pending_copies(self) -> list[tuple[Hashable, KvOp]]:
        """(owner, op) for every queued op, in order (a copy of the queue): the owner is
        the sequence whose admission queued a copy, or `CACHE` for a move of a cached
        block between tiers."""
        return list(self._copy_ops)

    def take_copy_ops(self) -> list[KvOp]:
        """Pending ops, in the order they must be applied; the queue is emptied.

        The caller applies them all before its next forward pass (a commit past a
        sequence's admission says that pass ran, copies first): `BlockCopy`, and with a
        host tier `BlockOffload` and `BlockOnboard`. The event log records each as a
        "copy", "offload" or "onboard" event (block_ids = (src, dst)).
        """
        queued = self._copy_ops
        self._copy_ops = []
        if self.events is not None:
            self.events += [op_event(owner, op, self._B) for owner, op in queued]
        return [op for _, op in queued]

    def take_kv_events(self) -> list[KvCacheEvent]:
        """KV-cache events since the last call, oldest first (BlockStored, BlockRemoved,
        AllBlocksCleared); the queue is emptied. ValueError unless built with
        kv_events=True."""
        if self._kv is None:
            raise ValueError("take_kv_events: the manager was built with kv_events=False")
        return self._kv.take()

    def reset_cache(self) -> None:
        """Drop every cached block (vLLM's reset_prefix_cache); with KV events on, records
        AllBlocksCleared. Raises ValueError while any sequence is live (their blocks are
        in use), changing nothing."""
        if self.sequences:
            raise ValueError(f"reset_cache: {len(self.sequences)} sequences are live; "
                             "free them first")
        self._version += 1
        cached = [b for _, node in self.tree.walk() if not node.host for b in node.blocks]
        self.tree = BlockRadixTree(self._B)
        self.pool.reset(self.tree)
        if self._kv is not None:
            self._kv.cleared()
        if self.on_blocks_removed is not None and cached:
            self.on_blocks_removed(cached)

    def get_sequence(self, seq_id: Hashable) -> Sequence:
        """The live handle of `seq_id`; ValueError if it is not live."""
        return self._get(seq_id, "get_sequence")

    def _get(self, seq_id: Hashable, where: str) -> Sequence:
        seq = self.sequences.get(seq_id)
        if seq is None:
            raise _unknown(where, seq_id)
        return seq

    def stats(self) -> KvCacheStats:
        """Cumulative statistics (gauges are current)."""
        pool = self.pool
        c = self._c
        free = pool.num_available
        private = sum(s.num_private_blocks for s in self.sequences.values())
        host = self._host
        return KvCacheStats(
            max_num_blocks=pool.num_blocks, free_num_blocks=free,
            used_num_blocks=pool.num_blocks - free, tokens_per_block=self._B,
            alloc_total_blocks=c.alloc_total, alloc_new_blocks=c.alloc_new,
            reused_blocks=c.full_reused + c.partial_reused, missed_blocks=c.missed,
            full_reused_blocks=c.full_reused, partial_reused_blocks=c.partial_reused,
            reused_tokens=c.reused_tokens, decode_alloc_blocks=c.decode_alloc,
            copied_blocks=c.copied, claimed_blocks=c.claimed, evicted_blocks=pool.num_evicted,
            cached_num_blocks=pool.num_blocks - pool.num_free - private,
            **({} if host is None else {
                "offloaded_blocks": host.num_offloaded, "onboarded_blocks": host.num_onboarded,
                "dropped_blocks": host.num_dropped, "max_num_host_blocks": host.num_slots,
                "cached_num_host_blocks": host.num_cached}))

    def step_stats(self) -> KvCacheStats:
        """Counters since the previous `step_stats()` call (since start for the first)."""
        now = self.stats()
        base = self._step_base
        self._step_base = now
        if base is None:
            return now
        return now.minus(base)

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of tree, pool, sequences."""
        check_manager(self)

    def leak_report(self) -> list[str]:
        """One line per leak: live sequences, pending copies, stray references."""
        lines = [f"sequence {s.seq_id!r} is still live, holding {len(s.live_block_ids())} blocks"
                 for s in self.sequences.values()]
        # a sequence's copies die with it; moves of cached blocks (CACHE's) wait for the
        # next step's take, whenever it comes: pending, not leaked
        copies = sum(owner is not CACHE for owner, _ in self._copy_ops)
        if copies:
            lines.append(f"{copies} copy ops were never taken")
        if not self.sequences:
            lines += [f"node {node!r} in scope {key!r} has ref {node.ref} with no live sequence"
                      for key, node in self.tree.walk() if node.ref]
        free = self.pool.num_available
        if not self.sequences and free != self.pool.num_blocks:
            lines.append(f"{self.pool.num_blocks - free} blocks are neither free nor evictable")
        host = self._host
        if not self.sequences and host is not None and host.num_available != host.num_slots:
            lines.append(f"{host.num_slots - host.num_available} host slots are neither free "
                         "nor droppable")
        return lines

    def dump_tree(self) -> str:
        """The cache tree as text, for failure messages."""
        return self.tree.dump()
