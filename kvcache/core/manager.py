"""KvCacheManager: admit sequences with reuse, commit, append, free, look up, count.

The manager touches no tensors: it hands out block ids and ops (`BlockCopy`, and with a
host tier `BlockOffload` and `BlockOnboard`) that the engine applies to storage, in queue
order, before its next forward pass. It changes the tree and the pools only through their
methods. Admission is one walk: `plan_admission` works out what a prompt would reuse and
need, `admit` carries it out.

With `KvCacheConfig.sliding_window` set, a sequence holds only the blocks some later
token's window can reach (kvcache/core/window.py): `commit` releases the rest, prompt
blocks are allocated as the engine reserves them chunk by chunk, and a match needs only
the cached blocks inside the window of its first new token.

One object with explicit steps over a plain state: `state` (a `CacheState`, state.py) is
all it keeps and the one way to read the cache (its config, tree, pools, event log);
`sequences` maps each live seq_id to its read-only `SequenceHandle` (handle.py). Each
call checks its arguments, then does the work on the state, itself or by calling the
function that does it with that state: `admission.make_plan` and `admission.carry_out`,
`caching.cache_full_blocks` and `caching.cache_tail`, `growth.reserve_blocks` and
`growth.append_blocks`, `window_holds.release_front`; `stats.py` and `integrity.py` read
it. A listener (`add_listener`, listener.py) hears of the blocks removed and moved.

Each call's contract (t: tokens, s: scope, c: first_chunk, p: priority). Bad input
raises ValueError naming the value, no room raises OutOfBlocksError (`OOB`); a call that
raises changed nothing (tree, pools, records, op queue, counters, LRU times and both
event logs are as they were), so it can be retried.

    call                      changes                                  raises
    plan_admission(t, s, c)   nothing; the plan is valid until the     ValueError: empty prompt,
                              cache next changes                       bad tokens, scope, first
                                                                       chunk
    admit(id, plan, p)        a new record and handle: holds its hits, ValueError: live id, bad
                              claims or queues a copy of a partial     priority, another
                              hit, allocates (evicting, offloading),   manager's or a stale
                              queues onboards; counters, logs          plan; OOB: no room
    add_sequence(id, t, s, p) plan_admission, then admit               what both raise
    commit(id, n)             tokens [0, n) valid: full blocks enter   ValueError: unknown id;
                              the tree (a duplicate switches to the    n not an int, past the
                              cached block, bumping block_ids_version, sequence or its reserved
                              its own block given back); a window      blocks, or backwards;
                              releases what no later token sees        its copy still queued
    reserve(id, n)            allocates what the pool can give for     ValueError: unknown id, n
                              tokens [0, n) (a window's chunks)        outside [0, tokens];
                                                                       never for want of room
    append_tokens(id, t)      appends tokens, allocating blocks        ValueError: unknown id,
                                                                       bad tokens; OOB
    free_sequence(id)         drops the record, its queued copies and  ValueError: unknown id
                              holds; a written partial tail is cached;
                              private blocks return to the pool
    match_reuse, probe_reuse  nothing, not even LRU times or counters  ValueError: bad tokens,
                                                                       scope, first chunk
    pending_copy_ops          nothing (a copy of the queued ops)       -
    ack_copy_ops(n)           the first n queued ops leave the queue   ValueError: n not in
                              and the event log records them           [0, number queued]
    take_copy_ops()           ack_copy_ops of every queued op          -
    add_listener(l)           l hears of every later removal and move  -
    take_kv_events()          empties the KV event queue               ValueError: kv_events off
    reset_cache()             drops every cached block, both tiers;    ValueError: a sequence
                              the KV event log and the listeners hear  is live
                              of it
    stats(), step_stats()     step_stats() moves its baseline          -
    check_integrity()         nothing                                  IntegrityError
    leak_report()             nothing                                  -
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType

from kvcache.core.admission import carry_out, make_plan
from kvcache.core.caching import cache_full_blocks, cache_tail
from kvcache.core.config import KvCacheConfig
from kvcache.core.events import CacheEvent, op_event
from kvcache.core.growth import append_blocks, reserve_blocks
from kvcache.core.handle import SequenceHandle, SequenceRecord
from kvcache.core.integrity import check_state, leak_report
from kvcache.core.keys import ReuseScope, scope_key, to_token_array, token_array_and_key
from kvcache.core.kv_events import KvCacheEvent
from kvcache.core.listener import CacheListener
from kvcache.core.ops import KvOp
from kvcache.core.plan import AdmissionPlan, ReuseMatch
from kvcache.core.pool import OutOfBlocksError
from kvcache.core.radix import BlockRadixTree
from kvcache.core.state import CacheState
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


def _label(where: str, seq_id: Hashable) -> str:
    """`where`, with `seq_id` when the call has one: "add_sequence('a')"."""
    return where if seq_id is None else f"{where}({seq_id!r})"


class KvCacheManager:
    """A paged KV cache's bookkeeping: a block radix tree over a fixed block pool.

    `KvCacheManager(config, record_events=False, kv_events=False)`: `record_events`
    keeps every operation in `state.events` (CacheEvent, for the reuse oracle);
    `kv_events` records KV-cache events for routers (`take_kv_events`). Raises ValueError
    for a `config` that is not a KvCacheConfig, or one whose pools' free lists do not fit
    in memory (naming `max_num_blocks` or `host_cache_blocks`).

    `state` is all it keeps (read it, never change it, but for its fault-injection seam
    `state.allocation_fault`); `sequences` maps each live seq_id to its handle
    (read-only). The module's table gives every call's contract.
    """

    def __init__(self, config: KvCacheConfig, *, record_events: bool = False,
                 kv_events: bool = False) -> None:
        self.state = CacheState(config, record_events=record_events, kv_events=kv_events)
        # the state's handles, read-only: it follows every admission and free
        self.sequences: Mapping[Hashable, SequenceHandle] = MappingProxyType(
            self.state.handles)
        self._step_base: KvCacheStats | None = None

    # ------------------------------------------------------------------ admission
    def plan_admission(self, tokens: Sequence[int], scope: ReuseScope | None = None, *,
                       first_chunk: int | None = None) -> AdmissionPlan:
        """What admitting `tokens` in `scope` would reuse and need now. Changes nothing.

        Pass the plan to `admit` before the cache changes again. A plan that does not
        fit says so (`fits` is False); it is not an error. Under a sliding window,
        `first_chunk` caps the tokens the first step computes: only their blocks are
        allocated, later ones come from `reserve` (None: the whole prompt's, as always
        under full attention). Raises ValueError for an empty prompt, bad tokens, a bad
        scope or a `first_chunk` that is not a positive int.
        """
        plan = self._plan("plan_admission", None, tokens, scope, first_chunk, admission=True)
        assert plan is not None  # an admission's empty prompt raised
        return plan

    def admit(self, seq_id: Hashable, plan: AdmissionPlan,
              priority: int = DEFAULT_PRIORITY) -> SequenceHandle:
        """Carry out `plan` for a new sequence `seq_id`; returns its live handle.

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
        state = self.state
        if seq_id in state.records:
            raise ValueError(f"admit({seq_id!r}): seq_id is already live")
        # the checks format their messages only on failure: an f-string per call would
        # cost as much as the rest of the checks
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            priority = check_priority(priority, f"admit({seq_id!r})")
        if plan.cache is not state:  # its nodes are another tree's, whatever its version
            raise ValueError(f"admit({seq_id!r}): {plan!r} was made by another "
                             "KvCacheManager, not this one; plan with this manager's "
                             "plan_admission")
        if plan.version != state.version:
            raise ValueError(f"admit({seq_id!r}): stale plan: the cache changed after "
                             "plan_admission; plan again")
        need = plan.num_new_blocks + plan.num_onboard_blocks
        if need > plan.num_available or plan.injected_fault:  # not plan.fits
            fault = " [injected fault]" if plan.injected_fault else ""
            raise OutOfBlocksError(f"add_sequence({seq_id!r}){fault}", need,
                                   0 if plan.injected_fault else plan.num_available,
                                   state.pool.num_blocks)
        return carry_out(state, seq_id, plan, priority)

    def add_sequence(self, seq_id: Hashable, tokens: Sequence[int],
                     scope: ReuseScope | None = None,
                     priority: int = DEFAULT_PRIORITY) -> SequenceHandle:
        """Plan and admit in one call (see `plan_admission` and `admit`).

        Raises ValueError for a live `seq_id`, an empty prompt, bad tokens, scope or
        priority, and OutOfBlocksError when the blocks cannot be had; either way nothing
        changes.
        """
        if seq_id in self.state.records:
            raise ValueError(f"add_sequence({seq_id!r}): seq_id is already live")
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            priority = check_priority(priority, f"add_sequence({seq_id!r})")
        plan = self._plan("add_sequence", seq_id, tokens, scope, None, admission=True)
        assert plan is not None  # an admission's empty prompt raised
        return self.admit(seq_id, plan, priority)

    def _plan(self, where: str, seq_id: Hashable, tokens: Sequence[int],
              scope: ReuseScope | None, first_chunk: int | None, *,
              admission: bool) -> AdmissionPlan | None:
        """The prologue of every call that reads a prompt, then its plan: checks `scope`,
        `tokens` and `first_chunk` (raising ValueError that names `where`, and `seq_id`
        when not None), converts the tokens once, and plans. An empty prompt raises for
        an `admission` (asked of the fault-injection seam too), and is None for a
        lookup, which reuses nothing. Changes nothing."""
        key = None if scope is None else scope_key(scope, _label(where, seq_id))
        prompt, key_bytes = token_array_and_key(tokens, where, seq_id)
        if not prompt and admission:
            raise ValueError(f"{_label(where, seq_id)}: empty prompt")
        if first_chunk is not None and (type(first_chunk) is not int or first_chunk < 1):
            first_chunk = check_positive_int(first_chunk, f"{_label(where, seq_id)}: "
                                             "first_chunk")
        if not prompt:
            return None
        fault = self.state.allocation_fault if admission else None
        return make_plan(self.state, prompt, key_bytes, key, first_chunk,
                         fault is not None and self._refused(fault, len(prompt)))

    def _refused(self, fault: Callable[[str, int], bool], num_tokens: int) -> bool:
        """Whether the fault-injection seam `fault` refuses admitting a prompt of
        `num_tokens` (asked with all its blocks, whatever a first chunk needs now)."""
        block_size = self.state.tokens_per_block
        return bool(fault("add_sequence", (num_tokens + block_size - 1) // block_size))

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
        state = self.state
        record = state.records.get(seq_id)
        if record is None:
            raise _unknown("commit", seq_id)
        n = num_tokens
        if type(n) is not int:
            n = check_int(num_tokens, f"commit({seq_id!r}): num_tokens")
        if n > len(record.tokens):
            raise ValueError(f"commit({seq_id!r}, {n}): beyond the sequence's "
                             f"{len(record.tokens)} tokens")
        committed = record.num_committed_tokens
        if n < committed:
            raise ValueError(f"commit({seq_id!r}, {n}): goes backwards; "
                             f"{committed} tokens are already committed")
        covered = len(record.block_ids) * state.tokens_per_block
        if n > covered:  # only under a window: tokens not reserved
            raise ValueError(f"commit({seq_id!r}, {n}): only {covered} tokens have blocks; "
                             "reserve the rest before computing them")
        if state.op_queue and n > committed:
            self._check_copied(seq_id, n)
        state.version += 1
        record.num_committed_tokens = n
        num_full = n // state.tokens_per_block
        switched = record.block_ids_version
        if state.reuse and num_full > record.num_tree_blocks:
            cache_full_blocks(state, record, num_full)
        if state.events is not None:
            ids = tuple(record.block_ids) if record.block_ids_version != switched else ()
            state.events.append(CacheEvent("commit", seq_id, (), n, None, ids))
        if state.window_left is not None:  # under full attention every block stays needed
            self._slide(record)

    def _slide(self, record: SequenceRecord) -> None:
        """Release the blocks no token from `num_committed_tokens` on can see."""
        state = self.state
        assert state.window_left is not None
        new = first_held_block(record.num_committed_tokens, state.window_left,
                               state.tokens_per_block,
                               record.num_tree_blocks if state.reuse else None)
        if new > record.num_released_blocks:
            release_front(state.pool, record, new, state.reuse)

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int:
        """Allocate blocks for tokens [0, num_tokens) of `seq_id`, as many as the pool
        can give; returns how many of those tokens its blocks now cover.

        Under a sliding window prompt blocks are allocated as chunks need them; under
        full attention admission allocated them all and this only checks. Never raises
        for lack of room (the caller computes fewer tokens, or preempts). Raises
        ValueError for an unknown `seq_id` or a count outside [0, tokens of the sequence].
        """
        record = self._record(seq_id, "reserve")
        n = check_int(num_tokens, f"reserve({seq_id!r}): num_tokens", 0, len(record.tokens))
        block_size = self.state.tokens_per_block
        need = (n + block_size - 1) // block_size - len(record.block_ids)
        if need > 0:
            reserve_blocks(self.state, record, need)
        return min(n, len(record.block_ids) * block_size)

    def append_tokens(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Append generated tokens, allocating blocks as needed.

        Raises ValueError for bad tokens or an unknown `seq_id`, OutOfBlocksError when the
        new blocks cannot be had; either way nothing changes.
        """
        record = self._record(seq_id, "append_tokens")
        added = to_token_array(tokens, "append_tokens", seq_id)
        block_size = self.state.tokens_per_block
        need = ((len(record.tokens) + len(added) + block_size - 1) // block_size
                - len(record.block_ids))
        if need > 0:
            append_blocks(self.state, record, need)
        record.tokens.extend(added)
        events = self.state.events
        if events is not None:
            blocks = tuple(record.block_ids[len(record.block_ids) - max(need, 0):])
            events.append(CacheEvent("append", seq_id, tuple(added), 0, None, blocks))

    def free_sequence(self, seq_id: Hashable) -> None:
        """Release a sequence: its committed blocks stay cached, the rest return to the pool.

        With partial reuse on, a committed partial tail is cached as a partial leaf unless
        an existing block already starts with it (with it off, a tail could never be
        matched). A copy of this sequence still queued never ran: it is dropped, and the
        tokens it was to write are not cached (its tail is cached only from written KV).
        """
        state = self.state
        record = state.records.pop(seq_id, None)
        if record is None:
            raise _unknown("free_sequence", seq_id)
        del state.handles[seq_id]
        state.version += 1
        unwritten = bool(state.op_queue) and self._drop_copies(seq_id)
        if state.kv_event_log is not None:
            state.kv_event_log.freed(seq_id)
        if state.events is not None:
            state.events.append(CacheEvent("free", seq_id, (), 0, None))
        pool = state.pool
        pool.tick()
        keep = record.num_tree_blocks
        if state.reuse:
            if (state.partial_reuse and record.num_committed_tokens % state.tokens_per_block
                    and not unwritten and cache_tail(state, record)):
                keep += 1
            last = record.last_node
            if last is not None:
                first = record.num_released_blocks
                pool.release(last, segment_stop(pool, last, record.num_tree_blocks, first)
                             if first else None)
        pool.give_back(record.live_block_ids(keep))

    # ------------------------------------------------------------------ queries
    def match_reuse(self, tokens: Sequence[int], scope: ReuseScope | None = None, *,
                    first_chunk: int | None = None) -> ReuseMatch:
        """What an admission of `tokens` in `scope` would reuse now: block ids and counts.

        The lookup of a scheduler, router or benchmark that does not admit: the admission
        plan's walk (`plan_admission(...).reuse`, claims under pool pressure included), holding
        and changing nothing, not even LRU times or statistics. `first_chunk` as
        `plan_admission`'s: a chunked admission needs fewer blocks, so under pressure it
        may keep a partial match the whole prompt's would forgo. An empty prompt reuses
        nothing. Raises ValueError for bad tokens, a bad scope or a bad `first_chunk`.
        """
        plan = self._plan("match_reuse", None, tokens, scope, first_chunk, admission=False)
        return ReuseMatch((), 0, 0, None) if plan is None else plan.reuse

    def probe_reuse(self, tokens: Sequence[int], scope: ReuseScope | None = None, *,
                    first_chunk: int | None = None) -> int:
        """Tokens an admission of `tokens` would reuse now (`match_reuse(...).num_tokens`,
        `first_chunk` as there). Holds and changes nothing; raises as `match_reuse`."""
        plan = self._plan("probe_reuse", None, tokens, scope, first_chunk, admission=False)
        return 0 if plan is None else plan.num_cached_tokens

    # ------------------------------------------------------------------ the op queue
    def _check_copied(self, seq_id: Hashable, n: int) -> None:
        """Raise ValueError if an op of `seq_id` is still queued: a commit of `n` tokens
        past its admission would count the slots its copy was to fill as written KV."""
        for owner, op in self.state.op_queue:
            if owner == seq_id:
                raise ValueError(f"commit({seq_id!r}, {n}): its {op} is still queued, so "
                                 "the forward pass that computed these tokens did not "
                                 "read the copied KV; take_copy_ops() and apply the ops "
                                 "before the forward pass, then commit")

    def _drop_copies(self, seq_id: Hashable) -> bool:
        """Forget the queued copies of `seq_id` (never the moves of cached blocks between
        tiers, owned by CACHE: the tree depends on them); returns whether there were any."""
        state = self.state
        kept = [entry for entry in state.op_queue if entry[0] != seq_id]
        dropped = len(kept) != len(state.op_queue)
        state.op_queue = kept
        return dropped

    @property
    def pending_copy_ops(self) -> list[KvOp]:
        """Ops queued and not yet applied, in the order they must be applied (a copy of
        the queue; taking it changes nothing): what an engine hands its storage, then
        acknowledges with `ack_copy_ops`. Who queued each (a sequence, or `CACHE` for a
        move of a cached block between tiers) is in `state.op_queue`."""
        return [op for _, op in self.state.op_queue]

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
        state = self.state
        queued = state.op_queue
        n = num_applied
        if type(n) is not int or not 0 <= n <= len(queued):
            n = check_int(num_applied, "ack_copy_ops: num_applied", 0, len(queued))
        if not n:
            return
        state.op_queue = queued[n:]
        if state.events is not None:
            state.events += [op_event(owner, op, state.tokens_per_block)
                             for owner, op in queued[:n]]

    def take_copy_ops(self) -> list[KvOp]:
        """Pending ops, in the order they must be applied; the queue is emptied, as if
        all of them were applied (`pending_copy_ops`, then `ack_copy_ops` of them all).
        For a caller with no storage to fail (the harness's replays, tests); an engine
        acknowledges only what its storage applied."""
        ops = self.pending_copy_ops
        self.ack_copy_ops(len(ops))
        return ops

    # ------------------------------------------------------------------ listeners, reset
    def take_kv_events(self) -> list[KvCacheEvent]:
        """KV-cache events since the last call, oldest first (BlockStored, BlockRemoved,
        AllBlocksCleared); the queue is emptied. ValueError unless built with
        kv_events=True."""
        log = self.state.kv_event_log
        if log is None:
            raise ValueError("take_kv_events: the manager was built with kv_events=False")
        return log.take()

    def add_listener(self, listener: CacheListener) -> None:
        """Tell `listener` from now on of every block the cache stops holding and every
        move of a cached block between the tiers (removed, offloaded, onboarded, dropped,
        cleared; see listener.CacheListener), after the KV event log: what a caller keeps
        per block (the engine's recurrent-state snapshots) leaves with its block and
        follows it to the host and back."""
        state = self.state
        state.listeners.append(listener)
        if state.host is not None:
            state.host.listeners.append(listener)

    def reset_cache(self) -> None:
        """Drop every cached block (vLLM's reset_prefix_cache); with KV events on, records
        AllBlocksCleared. Every listener hears `cleared`, then `removed` of the device
        blocks. Raises ValueError while any sequence is live (their blocks are in use),
        changing nothing."""
        state = self.state
        if state.records:
            raise ValueError(f"reset_cache: {len(state.records)} sequences are live; "
                             "free them first")
        state.version += 1
        cached = [b for _, node in state.tree.walk() if not node.host for b in node.blocks]
        state.tree = BlockRadixTree(state.tokens_per_block)
        state.pool.reset(state.tree)
        if state.kv_event_log is not None:
            state.kv_event_log.cleared()
        for listener in state.listeners:
            listener.cleared()
        if cached:
            for listener in state.listeners:
                listener.removed(cached)

    # ------------------------------------------------------------------ inspection
    def _record(self, seq_id: Hashable, where: str) -> SequenceRecord:
        record = self.state.records.get(seq_id)
        if record is None:
            raise _unknown(where, seq_id)
        return record

    def stats(self) -> KvCacheStats:
        """Cumulative statistics (gauges are current)."""
        state = self.state
        private = sum(record.num_private_blocks() for record in state.records.values())
        return cache_stats(state.counters, state.pool, private, state.tokens_per_block)

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
        check_state(self.state)

    def leak_report(self) -> list[str]:
        """One line per leak: live sequences, pending copies, stray references."""
        return leak_report(self.state)
