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

This class checks every call, then does the work; the work lives beside it, one concept
a module, as classes over the state it inherits (`state.py`): `admission.py` (the
plan's walk and carrying it out), `caching.py` (committed blocks and tails into the
tree), `growth.py` (blocks after admission); `stats.py` (counters and statistics) and
`integrity.py` (invariants and the leak report) are functions of it.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as Seq

from kvcache.core.admission import Admission
from kvcache.core.caching import Caching
from kvcache.core.events import CacheEvent, op_event
from kvcache.core.growth import Growth
from kvcache.core.handle import Sequence
from kvcache.core.host_tier import TierListener
from kvcache.core.integrity import check_manager, leak_report
from kvcache.core.keys import ReuseScope, scope_key, to_token_array, token_bytes
from kvcache.core.kv_events import KvCacheEvent
from kvcache.core.ops import KvOp
from kvcache.core.plan import AdmissionPlan, ReuseMatch
from kvcache.core.pool import OutOfBlocksError
from kvcache.core.radix import BlockRadixTree
from kvcache.core.stats import KvCacheStats, cache_stats
from kvcache.core.validate import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    check_int,
    check_positive_int,
    check_priority,
)
from kvcache.core.window import first_held_block
from kvcache.core.window_holds import release_front, segment_stop

DEFAULT_PRIORITY = 35


def _unknown(where: str, seq_id: Hashable) -> ValueError:
    return ValueError(f"{where}: unknown seq_id {seq_id!r} (not admitted, or freed)")


class KVCacheManager(Admission, Caching, Growth):
    """A paged KV cache's bookkeeping: a block radix tree over a fixed block pool.

    `KVCacheManager(config, record_events=False, kv_events=False)`: `record_events`
    keeps every operation in `events` (CacheEvent, for the reuse oracle); `kv_events`
    records KV-cache events for routers (`take_kv_events`). Raises ValueError for a
    `config` that is not a KvCacheConfig, or one whose pools' free lists do not fit in
    memory (naming `max_num_blocks` or `host_cache_blocks`).
    """

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
        plan = self._make_plan(arr, kb, skey, first_chunk)
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
        a live `seq_id`, a bad priority, a plan another manager made (its tree nodes are
        that manager's) or a stale plan (the cache changed since it was made), and
        OutOfBlocksError for a plan that does not fit; either way nothing changes.
        """
        if seq_id in self.sequences:
            raise ValueError(f"admit({seq_id!r}): seq_id is already live")
        # the checks format their messages only on failure: an f-string per call would
        # cost as much as the rest of the checks
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            priority = check_priority(priority, f"admit({seq_id!r})")
        if plan._maker is not self:  # its nodes are another tree's, whatever its version
            raise ValueError(f"admit({seq_id!r}): {plan!r} was made by another "
                             "KVCacheManager, not this one; plan with this manager's "
                             "plan_admission")
        if plan._version != self._version:
            raise ValueError(f"admit({seq_id!r}): stale plan: the cache changed after "
                             "plan_admission; plan again")
        pool = self.pool
        if plan._need + plan._onboard > plan._available or plan._fault:  # not plan.fits
            fault = " [injected fault]" if plan._fault else ""
            raise OutOfBlocksError(f"add_sequence({seq_id!r}){fault}",
                                   plan._need + plan._onboard,
                                   0 if plan._fault else plan._available, pool.num_blocks)
        return self._carry_out(seq_id, plan, priority)

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
        plan = self._make_plan(arr, kb, skey)
        fault = self.allocation_fault
        if fault is not None and fault("add_sequence", plan._num_blocks):
            plan._fault = True
        return self.admit(seq_id, plan, priority)

    # ------------------------------------------------------------------ progress
    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Mark the KV of tokens [0, num_tokens) valid; its full blocks become reusable.

        A full block equal to one already cached is deduplicated: the sequence switches to
        the cached block and its own returns to the pool, so `block_ids` changes in place
        and `block_ids_version` is bumped (re-read the ids before the next forward pass).
        Committing past the admission says a forward pass ran, and copies are applied
        before every forward pass: take the queue (`take_copy_ops`) and apply it first.
        Raises ValueError for an unknown `seq_id`, a count beyond the sequence, below an
        earlier commit, (sliding window) beyond the blocks reserved so far, or past the
        admission while the sequence's copy is still queued (its tokens were never
        written); nothing changes then.
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
        if n > len(seq._block_ids) * self._B:  # only under a window: tokens not reserved
            raise ValueError(f"commit({seq_id!r}, {n}): only {len(seq._block_ids) * self._B} "
                             "tokens have blocks; reserve the rest before computing them")
        if self._copy_ops and n > seq._committed:
            self._check_copied(seq_id, n)
        self._version += 1
        seq._committed = n
        nfull = n // self._B
        switched = seq._block_ids_version
        if self.reuse and nfull > seq._tree_blocks:
            self._cache_full_blocks(seq, nfull)
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
            self._reserve_blocks(seq, need)
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
            self._append_blocks(seq, need)
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

    # ------------------------------------------------------------------ queries
    def match_reuse(self, tokens: Seq[int], scope: ReuseScope | None = None, *,
                    first_chunk: int | None = None) -> ReuseMatch:
        """What an admission of `tokens` in `scope` would reuse now: block ids and counts.

        The lookup of a scheduler, router or benchmark that does not admit: the admission
        plan's walk (`plan_admission(...).reuse`, claims under pool pressure included), holding
        and changing nothing, not even LRU times or statistics. `first_chunk` as
        `plan_admission`'s: a chunked admission needs fewer blocks, so under pressure it
        may keep a partial match the whole prompt's would forgo. An empty prompt reuses
        nothing. Raises ValueError for bad tokens, a bad scope or a bad `first_chunk`.
        """
        skey = None if scope is None else scope_key(scope, "match_reuse")
        arr, kb = token_bytes(tokens, "match_reuse", None)
        if first_chunk is not None:
            first_chunk = check_positive_int(first_chunk, "match_reuse: first_chunk")
        if not arr:
            return ReuseMatch((), 0, 0, None)
        return self._make_plan(arr, kb, skey, first_chunk).reuse

    def probe_reuse(self, tokens: Seq[int], scope: ReuseScope | None = None, *,
                    first_chunk: int | None = None) -> int:
        """Tokens an admission of `tokens` would reuse now (`match_reuse(...).num_tokens`,
        `first_chunk` as there). Holds and changes nothing."""
        arr, kb = token_bytes(tokens, "probe_reuse", None)
        if first_chunk is not None:
            first_chunk = check_positive_int(first_chunk, "probe_reuse: first_chunk")
        if not arr:
            return 0
        return self._make_plan(arr, kb, scope_key(scope, "probe_reuse"), first_chunk)._cached

    def _check_copied(self, seq_id: Hashable, n: int) -> None:
        """Raise ValueError if an op of `seq_id` is still queued: a commit of `n` tokens
        past its admission would count the slots its copy was to fill as written KV."""
        for owner, op in self._copy_ops:
            if owner == seq_id:
                raise ValueError(f"commit({seq_id!r}, {n}): its {op} is still queued, so "
                                 "the forward pass that computed these tokens did not "
                                 "read the copied KV; take_copy_ops() and apply the ops "
                                 "before the forward pass, then commit")

    def _drop_copies(self, seq_id: Hashable) -> bool:
        """Forget the queued copies of `seq_id` (never the moves of cached blocks between
        tiers, owned by CACHE: the tree depends on them); returns whether there were any."""
        kept = [e for e in self._copy_ops if e[0] != seq_id]
        dropped = len(kept) != len(self._copy_ops)
        self._copy_ops = kept
        return dropped

    @property
    def pending_copy_ops(self) -> list[KvOp]:
        """Ops queued and not yet applied, in the order they must be applied (a copy of
        the queue; taking it changes nothing): what an engine hands its storage, then
        acknowledges with `ack_copy_ops`."""
        return [op for _, op in self._copy_ops]

    @property
    def pending_copies(self) -> list[tuple[Hashable, KvOp]]:
        """(owner, op) for every queued op, in order (a copy of the queue): the owner is
        the sequence whose admission queued a copy, or `CACHE` for a move of a cached
        block between tiers."""
        return list(self._copy_ops)

    def ack_copy_ops(self, num_applied: int) -> None:
        """The first `num_applied` ops of `pending_copy_ops` were applied to storage: they
        leave the queue (the rest stay queued, in order, to be applied next).

        The engine applies the pending ops before its next forward pass (a commit past a
        sequence's admission says that pass ran, so it is refused while the sequence's
        copy is queued): `BlockCopy`, and with a
        host tier `BlockOffload` and `BlockOnboard`. It acknowledges only what was
        applied, so an apply that fails part-way is retried from the first op it did
        not apply, and an applied op is never re-run (that is not safe: an offload of
        block X re-run after an onboard into X copies the wrong KV to the host). The
        event log records each acknowledged op as a "copy", "offload" or "onboard"
        event (block_ids = (src, dst)). Raises ValueError for a count that is not an int
        in [0, number pending], changing nothing.
        """
        queued = self._copy_ops
        n = num_applied
        if type(n) is not int or not 0 <= n <= len(queued):
            n = check_int(num_applied, "ack_copy_ops: num_applied", 0, len(queued))
        if not n:
            return
        self._copy_ops = queued[n:]
        if self.events is not None:
            self.events += [op_event(owner, op, self._B) for owner, op in queued[:n]]

    def take_copy_ops(self) -> list[KvOp]:
        """Pending ops, in the order they must be applied; the queue is emptied, as if
        all of them were applied (`pending_copy_ops`, then `ack_copy_ops` of them all).
        For a caller with no storage to fail (the harness's replays, tests); an engine
        acknowledges only what its storage applied."""
        ops = self.pending_copy_ops
        self.ack_copy_ops(len(ops))
        return ops

    def take_kv_events(self) -> list[KvCacheEvent]:
        """KV-cache events since the last call, oldest first (BlockStored, BlockRemoved,
        AllBlocksCleared); the queue is emptied. ValueError unless built with
        kv_events=True."""
        if self._kv is None:
            raise ValueError("take_kv_events: the manager was built with kv_events=False")
        return self._kv.take()

    def add_tier_listener(self, listener: TierListener) -> None:
        """Tell `listener` of every move of a cached block between the tiers from now on
        (offloaded, onboarded, dropped; see host_tier.TierListener), after the KV event
        log: what is kept per block (the engine's recurrent-state snapshots) can follow
        its block to the host and back. Raises ValueError without a host tier."""
        if self._host is None:
            raise ValueError("add_tier_listener: the manager has no host tier "
                             "(KvCacheConfig.host_cache_blocks=0)")
        self._host.listeners.append(listener)

    def reset_cache(self) -> None:
        """Drop every cached block (vLLM's reset_prefix_cache); with KV events on, records
        AllBlocksCleared. `on_blocks_removed` hears of the device blocks, every tier
        listener `cleared`. Raises ValueError while any sequence is live (their blocks are
        in use), changing nothing."""
        if self.sequences:
            raise ValueError(f"reset_cache: {len(self.sequences)} sequences are live; "
                             "free them first")
        self._version += 1
        cached = [b for _, node in self.tree.walk() if not node.host for b in node.blocks]
        self.tree = BlockRadixTree(self._B)
        self.pool.reset(self.tree)
        # the KV event log listens to the host tier when there is one, else only here
        listeners = self._host.listeners if self._host is not None else [self._kv] \
            if self._kv is not None else []
        for listener in listeners:
            listener.cleared()
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
        private = sum(s.num_private_blocks for s in self.sequences.values())
        return cache_stats(self._c, self.pool, private, self._B)

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
        return leak_report(self)

    def dump_tree(self) -> str:
        """The cache tree as text, for failure messages."""
        return self.tree.dump()
