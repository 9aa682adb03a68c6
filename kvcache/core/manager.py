"""KVCacheManager: admit sequences with reuse, commit, append, free, probe, stats.

The manager touches no tensors: it hands out block ids and `BlockCopy` ops that the engine
applies to storage before its next forward pass. It changes the tree and the pool only
through their methods. Every public mutator either succeeds or raises before changing
anything (bad input: ValueError; no room: OutOfBlocksError). Admission is one walk:
`plan_admission` works out what a prompt would reuse and need, `admit` carries it out.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq

from kvcache.core.config import KvCacheConfig
from kvcache.core.events import CacheEvent
from kvcache.core.handle import Sequence
from kvcache.core.integrity import check_manager
from kvcache.core.kv_event_log import KvEventLog
from kvcache.core.kv_events import KvCacheEvent
from kvcache.core.ops import BlockCopy
from kvcache.core.plan import AdmissionPlan
from kvcache.core.pool import BlockPool, OutOfBlocksError
from kvcache.core.radix import (
    TOKEN_BYTES,
    BlockRadixTree,
    Node,
    PartialHit,
    ReuseScope,
    ScopeKey,
    scope_key,
    to_token_array,
)
from kvcache.core.stats import KvCacheStats
from kvcache.core.validate import check_int, check_priority

DEFAULT_PRIORITY = 35


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
        self.tree = BlockRadixTree(self._B)
        self.pool = BlockPool(config.max_num_blocks, self.tree)
        self.reuse = config.block_reuse
        self._partial = config.partial_reuse
        self._copy = config.copy_on_partial
        self._align = config.reuse_alignment_blocks
        self.sequences: dict[Hashable, Sequence] = {}
        self._copy_ops: list[tuple[Hashable, BlockCopy]] = []
        self._c = _Counters()
        self._step_base: KvCacheStats | None = None
        self._version = 0  # bumped by every mutation: plans made before it are stale
        self.events: list[CacheEvent] | None = [] if record_events else None
        # KV-cache events for routers (blocks stored and removed), see kv_events.py
        self._kv = KvEventLog(self._B) if kv_events else None
        # Told the ids of cached blocks that left the tree (evicted, or claimed by an
        # admission), and of a sequence's own blocks given back when its commit switched
        # to equal cached ones, after the fact: the engine drops what it keeps per block.
        self.on_blocks_removed: Callable[[list[int]], None] | None = None
        # Test seam for fault injection: called as (operation, blocks needed) before any
        # allocation; returning True refuses it (a plan that does not fit, or
        # OutOfBlocksError from append_tokens), nothing changed.
        self.allocation_fault: Callable[[str, int], bool] | None = None

    # ------------------------------------------------------------------ admission
    def plan_admission(self, tokens: Seq[int], scope: ReuseScope | None = None) -> AdmissionPlan:
        """What admitting `tokens` in `scope` would reuse and need now. Changes nothing.

        Pass the plan to `admit` before the cache changes again. A plan that does not
        fit says so (`fits` is False); it is not an error. Raises ValueError for an
        empty prompt, bad tokens or a bad scope.
        """
        skey = None if scope is None else scope_key(scope, "plan_admission")
        arr = to_token_array(tokens, "plan_admission", None)
        if not arr:
            raise ValueError("plan_admission: empty prompt")
        plan = self._plan(arr, skey)
        fault = self.allocation_fault
        if fault is not None and fault("add_sequence", plan.num_blocks):
            plan._fault = True
        return plan

    def admit(self, seq_id: Hashable, plan: AdmissionPlan,
              priority: int = DEFAULT_PRIORITY) -> Sequence:
        """Carry out `plan` for a new sequence `seq_id`; returns its live `Sequence`.

        `num_cached_tokens` tokens (any alignment) need no compute. A partial hit on an
        unused leaf claims that block (it leaves the tree); otherwise it queues a
        `BlockCopy` for `take_copy_ops()`. Raises ValueError for a live `seq_id`, a bad
        priority or a stale plan (the cache changed since it was made), and
        OutOfBlocksError for a plan that does not fit; either way nothing changes.
        """
        if seq_id in self.sequences:
            raise ValueError(f"admit({seq_id!r}): seq_id is already live")
        priority = check_priority(priority, f"admit({seq_id!r})")
        if plan._version != self._version:
            raise ValueError(f"admit({seq_id!r}): stale plan: the cache changed after "
                             "plan_admission; plan again")
        pool = self.pool
        if not plan.fits:
            fault = " [injected fault]" if plan._fault else ""
            raise OutOfBlocksError(f"add_sequence({seq_id!r}){fault}", plan._need,
                                   0 if plan._fault else plan._available, pool.num_blocks)
        self._version += 1
        hits, ph, need, ids = plan._hits, plan._partial, plan._need, plan._block_ids[:]
        tree = self.tree
        deep = None
        if hits:
            last, nb = hits[-1]
            deep = tree.split(last, nb) if nb < len(last.blocks) else last
            pool.acquire(deep, None, priority)
        src = None
        followers: list[int] = []
        if ph is not None:
            node = ph.node  # after the split above it starts at the candidate block
            if ph.claim:
                if node.children or len(node.blocks) > 1:  # see _plan: a copy did not fit
                    followers = pool.evict_below(node)
                    self._removed(followers)
                pool.forget_cached(node)
                tree.detach(node)
                self._removed(node.blocks)
                ids.append(node.blocks[0])
            else:
                src = tree.split(node, 1) if len(node.blocks) > 1 else node
                pool.acquire(src, src.parent, priority)
        new, fresh = pool.allocate(need - len(followers))
        if fresh < len(new):
            self._removed(new[fresh:])
        new += followers
        if src is not None and ph is not None:
            self._copy_ops.append((seq_id, BlockCopy(src.blocks[0], new[0], ph.num_tokens)))
            pool.release(src, src.parent)
        ids += new
        seq = Sequence(seq_id, plan._tokens, plan._scope, priority, ids, plan._cached, deep,
                       plan._full)
        return self._admitted(seq, plan._num_blocks, plan._full, ph, need, fresh)

    def add_sequence(self, seq_id: Hashable, tokens: Seq[int], scope: ReuseScope | None = None,
                     priority: int = DEFAULT_PRIORITY) -> Sequence:
        """Plan and admit in one call (see `plan_admission` and `admit`).

        Raises ValueError for a live `seq_id`, an empty prompt, bad tokens, scope or
        priority, and OutOfBlocksError when the blocks cannot be had; either way nothing
        changes.
        """
        if seq_id in self.sequences:
            raise ValueError(f"add_sequence({seq_id!r}): seq_id is already live")
        priority = check_priority(priority, f"add_sequence({seq_id!r})")
        skey = None if scope is None else scope_key(scope, f"add_sequence({seq_id!r})")
        arr = to_token_array(tokens, "add_sequence", seq_id)
        if not arr:
            raise ValueError(f"add_sequence({seq_id!r}): empty prompt")
        plan = self._plan(arr, skey)
        fault = self.allocation_fault
        if fault is not None and fault("add_sequence", plan._num_blocks):
            plan._fault = True
        return self.admit(seq_id, plan, priority)

    def _plan(self, arr: array, skey: ScopeKey) -> AdmissionPlan:
        """The admission plan of token array `arr` in scope `skey` now. Pure.

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
            return AdmissionPlan(arr, skey, self._version, nblocks, [], 0, None, 0, nblocks,
                                 pool.num_available, [])
        hits, nfull, ph, ntok = self.tree.match(
            root, arr.tobytes(), (length - 1) * TOKEN_BYTES, partial=self._partial,
            copy_on_partial=self._copy)
        if nfull % self._align:
            hits, nfull, ntok = self._aligned(hits, nfull)
        avail = pool.num_available
        ids: list[int] = []
        for node, nb in hits:
            ids += node.blocks[:nb]
            if not node.ref:
                avail -= nb  # about to be referenced
        need = nblocks - nfull - (ph is not None and ph.claim)
        if ph is not None and not ph.node.ref:
            if ph.claim or need < avail:
                avail -= 1  # claimed, or a copy source protected during the admission
            elif need == avail:  # a copy does not fit: claim the source (see above)
                ph = ph._replace(claim=True)
                need -= 1
                avail -= 1
            else:
                ph, ntok = None, nfull * self._B
        return AdmissionPlan(arr, skey, self._version, nblocks, hits, nfull, ph, ntok, need,
                             avail, ids)

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
        out: list[tuple[Node, int]] = []
        left = keep
        for node, nb in hits:
            if not left:
                break
            out.append((node, min(nb, left)))
            left -= out[-1][1]
        return out, keep, keep * self._B

    def _admitted(self, seq: Sequence, nblocks: int, nfull: int, ph: PartialHit | None,
                  alloc: int, fresh: int) -> Sequence:
        c = self._c
        partial = ph is not None
        c.full_reused += nfull
        c.partial_reused += partial
        c.missed += nblocks - nfull - partial
        c.alloc_total += alloc
        c.alloc_new += fresh
        c.reused_tokens += seq._num_cached
        if ph is not None:
            if ph.claim:
                c.claimed += 1
            else:
                c.copied += 1
        seq._full_reused, seq._partial_reused = nfull, int(partial)
        seq._missed = nblocks - nfull - partial
        seq._alloc_total, seq._alloc_new = alloc, fresh
        self.sequences[seq._seq_id] = seq
        if self.events is not None:
            self.events.append(CacheEvent("admit", seq._seq_id, tuple(seq._tokens),
                                          seq._num_cached, seq._scope, tuple(seq._block_ids)))
        return seq

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
        seq = self._get(seq_id, "commit")
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

    def _insert(self, seq: Sequence, nfull: int) -> None:
        B = self._B
        t = seq._tree_blocks
        deep = seq._last
        tree = self.tree
        if deep is not None and deep.ref == 1 and not deep.children:
            # a leaf only this sequence holds: grow it in place, the tree stays compressed
            tree.extend_leaf(deep, seq._tokens[t * B:nfull * B].tobytes(),
                             seq._block_ids[t:nfull])
            if self._kv is not None:
                self._kv.stored(seq._seq_id, seq._tokens, seq._scope, t,
                                seq._block_ids[t:nfull])
            seq._tree_blocks = nfull
            return
        parent = deep if deep is not None else tree.root(seq._scope)
        kb = seq._tokens[t * B:nfull * B].tobytes()
        if parent.full:
            m = tree.match(parent, kb, len(kb), partial=False, copy_on_partial=False)
            if m.hits:  # someone committed the same blocks first: switch to theirs
                cached = [b for node, nb in m.hits for b in node.blocks[:nb]]
                last, nb = m.hits[-1]
                top = tree.split(last, nb) if nb < len(last.blocks) else last
                self.pool.acquire(top, parent, seq._priority)
                k = len(cached)
                own = seq._block_ids[t:t + k]
                seq._block_ids[t:t + k] = cached
                seq._block_ids_version += 1
                self.pool.give_back(own)
                if self.on_blocks_removed is not None:
                    self.on_blocks_removed(own)
                t += k
                kb = kb[k * tree.block_bytes:]
                parent = top
        if t < nfull:
            node = tree.add_child(parent, kb, seq._block_ids[t:nfull])
            if self._kv is not None:
                self._kv.stored(seq._seq_id, seq._tokens, seq._scope, t,
                                seq._block_ids[t:nfull])
            self.pool.hold_new(node, seq._priority)
            parent = node
        seq._last = parent
        seq._tree_blocks = nfull

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
            new, fresh = pool.allocate(need)
            if fresh < need:
                self._removed(new[fresh:])
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
        seq = self._get(seq_id, "free_sequence")
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
            if seq._last is not None:
                pool.release(seq._last)
        pool.give_back(seq._block_ids[keep:])

    def _cache_tail(self, seq: Sequence) -> bool:
        n = seq._committed
        start = n - n % self._B
        tail = seq._tokens[start:n].tobytes()
        parent = seq._last if seq._last is not None else self.tree.root(seq._scope)
        for c in parent.children.get(tail[:TOKEN_BYTES], ()):
            if c.key.startswith(tail):
                return False
        block = seq._block_ids[start // self._B]
        node = self.tree.add_child(parent, tail, [block])
        if self._kv is not None:
            self._kv.stored_partial(seq._seq_id, seq._tokens, seq._scope, start // self._B,
                                    n - start, block)
        self.pool.add_cached(node, seq._priority)
        return True

    # ------------------------------------------------------------------ queries
    def probe_reuse(self, tokens: Seq[int], scope: ReuseScope | None = None) -> int:
        """Tokens an admission of `tokens` would reuse now. Holds and changes nothing."""
        arr = to_token_array(tokens, "probe_reuse", None)
        if not arr:
            return 0
        return self._plan(arr, scope_key(scope, "probe_reuse"))._cached

    def _drop_copies(self, seq_id: Hashable) -> bool:
        """Forget the queued copies of `seq_id`; returns whether there were any."""
        kept = [e for e in self._copy_ops if e[0] != seq_id]
        dropped = len(kept) != len(self._copy_ops)
        self._copy_ops = kept
        return dropped

    @property
    def pending_copy_ops(self) -> list[BlockCopy]:
        """Copies queued and not yet taken (a copy of the queue; read-only view)."""
        return [op for _, op in self._copy_ops]

    @property
    def pending_copies(self) -> list[tuple[Hashable, BlockCopy]]:
        """(seq_id, copy) for every queued copy, in order (a copy of the queue)."""
        return list(self._copy_ops)

    def take_copy_ops(self) -> list[BlockCopy]:
        """Pending copies, in the order they must be applied; the queue is emptied.

        The caller applies them all before its next forward pass (a commit past a
        sequence's admission says that pass ran, copies first).
        """
        queued = self._copy_ops
        self._copy_ops = []
        if self.events is not None:
            self.events += [CacheEvent("copy", sid, (), op.num_tokens, None, (op.src, op.dst))
                            for sid, op in queued]
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
        cached = [b for _, node in self.tree.walk() for b in node.blocks]
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
            raise ValueError(f"{where}: unknown seq_id {seq_id!r} (not admitted, or freed)")
        return seq

    def stats(self) -> KvCacheStats:
        """Cumulative statistics (gauges are current)."""
        pool = self.pool
        c = self._c
        free = pool.num_available
        private = sum(s.num_private_blocks for s in self.sequences.values())
        return KvCacheStats(
            max_num_blocks=pool.num_blocks, free_num_blocks=free,
            used_num_blocks=pool.num_blocks - free, tokens_per_block=self._B,
            alloc_total_blocks=c.alloc_total, alloc_new_blocks=c.alloc_new,
            reused_blocks=c.full_reused + c.partial_reused, missed_blocks=c.missed,
            full_reused_blocks=c.full_reused, partial_reused_blocks=c.partial_reused,
            reused_tokens=c.reused_tokens, decode_alloc_blocks=c.decode_alloc,
            copied_blocks=c.copied, claimed_blocks=c.claimed, evicted_blocks=pool.num_evicted,
            cached_num_blocks=pool.num_blocks - pool.num_free - private)

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
        lines = [f"sequence {s.seq_id!r} is still live, holding {len(s.block_ids)} blocks"
                 for s in self.sequences.values()]
        if self._copy_ops:
            lines.append(f"{len(self._copy_ops)} copy ops were never taken")
        if not self.sequences:
            lines += [f"node {node!r} in scope {key!r} has ref {node.ref} with no live sequence"
                      for key, node in self.tree.walk() if node.ref]
        free = self.pool.num_available
        if not self.sequences and free != self.pool.num_blocks:
            lines.append(f"{self.pool.num_blocks - free} blocks are neither free nor evictable")
        return lines

    def dump_tree(self) -> str:
        """The cache tree as text, for failure messages."""
        return self.tree.dump()
