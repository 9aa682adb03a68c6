"""Admission: a prompt's plan (one walk of the tree) and carrying it out.

`_make_plan` is `KVCacheManager.plan_admission`'s work, and `match_reuse`'s and
`probe_reuse`'s: the walk, the reuse alignment, the sliding-window cut and the pressure
claim, changing nothing. `_carry_out` is `admit`'s once the manager has checked the call:
it holds the reused blocks, claims or copies the partial one, onboards host hits and
allocates the rest. A base class of KVCacheManager over its state (state.py);
only the manager's methods call these, after checking the call.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable

from kvcache.core.events import CacheEvent
from kvcache.core.handle import Sequence
from kvcache.core.keys import TOKEN_BYTES, ScopeKey
from kvcache.core.ops import BlockCopy, BlockOnboard
from kvcache.core.plan import AdmissionPlan
from kvcache.core.radix import Node
from kvcache.core.state import CacheState
from kvcache.core.window_holds import (
    Hits,
    cut_hits,
    cut_to_window,
    held_ids,
    segment_stop,
    unheld_below,
)


class Admission(CacheState):
    """The admission side of the manager: plans and carrying them out."""

    def _make_plan(self, arr: array, kb: bytes, skey: ScopeKey,
                  first_chunk: int | None = None) -> AdmissionPlan:
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
            return AdmissionPlan(self, arr, skey, self._version, nblocks, [], 0, None, 0,
                                 need, pool.num_available, [])
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
        return AdmissionPlan(self, arr, skey, self._version, nblocks, hits, nfull, ph, ntok,
                             need, avail, ids, first_block=first,
                             num_onboard_blocks=onboard)


    def _carry_out(self, seq_id: Hashable, plan: AdmissionPlan,
                  priority: int) -> Sequence:
        """Carry out `plan`, already checked (live id, priority, version, fit), for a new
        sequence `seq_id` (`KVCacheManager.admit`); returns its live `Sequence`. Mutates
        the tree, the pools, the op queue, the counters and `self.sequences`."""
        pool = self.pool
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
                if node.children or len(node.blocks) > 1:  # see _make_plan: a copy did not fit
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
                                         seq._scope, tuple(ids), priority))
        return seq


    def _end_block(self, length: int, num_cached: int, first_chunk: int | None
                   ) -> int:
        """Blocks an admission covers: every prompt block, or under a sliding window with
        a `first_chunk`, those of the tokens up to the end of that chunk."""
        if first_chunk is None or self._wl is None:
            return (length + self._B - 1) // self._B
        return (min(length, num_cached + first_chunk) + self._B - 1) // self._B


    def _aligned(self, hits: Hits, nfull: int) -> tuple[Hits, int, int]:
        """The hits cut back to a multiple of `reuse_alignment_blocks` full blocks (the
        blocks whose recurrent-state snapshot a hybrid model can restore from)."""
        keep = nfull - nfull % self._align
        return cut_hits(hits, keep), keep, keep * self._B
