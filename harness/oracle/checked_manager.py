"""CheckedManager: a KvCacheManager run under the provenance and capacity oracles.

Every call is forwarded to the manager and then checked. The oracles are fed events
built from the manager's public API (each handle's block ids and reused count, the copy
queue), not from its event log; when the manager keeps a log, the log must say the same,
since engines are checked by replaying theirs. After every call: every live sequence's
valid KV is its own (or arrives with a queued copy), usedNumBlocks is what the live
sequences need, and a call that raised left the manager exactly as it was and, if it
was refused for want of blocks, the blocks really were not there.

`commit` first takes and applies the queued copies, as an engine does before the forward
pass whose tokens it commits; `ack_copy_ops` applies only those acknowledged, as an engine
whose storage failed part-way does. Fuzzers and stateful tests drive this instead of a bare
manager; anything not wrapped (state, sequences, stats, probe_reuse, ...) is forwarded as
is, so a test sets the fault-injection seam as on the manager (`state.allocation_fault`).
Like the rest of the harness it imports `kvcache` for type checking only: a refusal is
any exception with `needed`, `available` and `capacity` (`OutOfBlocksError`).

Under a sliding window the capacity oracle restates the window rule: each sequence's
block positions (an admission's up to its first chunk, a `reserve`'s as many as are
available) and how many of them its commits released are checked after every call, and
a commit may turn released positions into None without bumping `block_ids_version`
(nothing there switched block).

What the two oracles check after a call is `CallOracles`, which reads nothing but the
call's events and the cache's block count: CheckedManager feeds it from kvcache's API,
the conformance judge (`harness.conform.controller.judge`) from the event log any implementation of
the cache-level protocol writes, so both hold a cache to the same checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from harness.oracle.capacity import CapacityOracle
from harness.oracle.provenance import Move, ShadowStore
from harness.oracle.types import MOVES, Event, normalize_event

if TYPE_CHECKING:
    from kvcache import AdmissionPlan, KvCacheManager, ReuseScope, SequenceHandle
    from kvcache.core.ops import KvOp

T = TypeVar("T")
# the op classes of kvcache.core.ops, by name -> the event kind the log records
_KINDS = {"BlockCopy": "copy", "BlockOffload": "offload", "BlockOnboard": "onboard"}


def _owner(owner: Hashable) -> Hashable:
    """The seq_id a move is logged under: "CACHE" for kvcache's CACHE owner (a move of a
    cached block between tiers), else the sequence that queued it."""
    return "CACHE" if type(owner).__name__ == "CacheOwner" else owner


def _same(logged: Event, api: Event) -> bool:
    """Whether the log's event says what the API's does. A commit logs its switched ids
    before its window's release: where the API shows a released position (None), the
    log may show the block it had."""
    if logged.kind != "commit" or api.kind != "commit" or None not in api.block_ids:
        return logged == api
    return (logged._replace(block_ids=()) == api._replace(block_ids=())
            and len(logged.block_ids) == len(api.block_ids)
            and all(b is None or a == b for a, b in zip(logged.block_ids, api.block_ids,
                                                        strict=True)))


def _logged_move(ev: Event) -> Move:
    """A logged move as (kind, src, dst, num_tokens)."""
    src, dst = ev.block_ids
    assert src is not None and dst is not None  # normalize_event refuses a move without
    return (ev.kind, src, dst, ev.num_tokens)


class CallOracles:
    """The provenance and capacity oracles, checked after each call of any cache from
    that call's events (mutates only itself).

    `provenance` and `capacity_after` are separate so that a caller which keeps going
    after one oracle's finding (the conformance judge) stops feeding only that one. Each
    raises ProvenanceError or CapacityError for a violation, ValueError for events that
    do not replay.
    """

    def __init__(self, tokens_per_block: int, max_num_blocks: int, *, block_reuse: bool,
                 sliding_window: int | None = None, repro: str = "") -> None:
        self.shadow = ShadowStore(tokens_per_block, repro=repro, sliding_window=sliding_window)
        self.capacity = CapacityOracle(tokens_per_block, max_num_blocks,
                                       block_reuse=block_reuse, sliding_window=sliding_window,
                                       repro=repro)

    def provenance(self, events: Sequence[Event], pending: list[Move]) -> None:
        """Apply `events` to the shadow store, then check that every live sequence's
        valid KV is its own with the `pending` moves (queued after the call) applied. An
        admission reads with the moves logged after it in `events` and `pending` queued
        (a cache that applies its copies within the call logs them there)."""
        for i, ev in enumerate(events):
            queued: list[Move] | None = None
            if ev.kind == "admit":
                queued = [_logged_move(e) for e in events[i + 1:] if e.kind in MOVES]
                queued += pending
            self.shadow.apply(ev, queued)
        self.shadow.check_live(pending)

    def capacity_after(self, where: str, events: Sequence[Event], used_blocks: int | None,
                       sequences: Sequence[tuple[Hashable, int, int]] = ()) -> None:
        """Apply `events` to the capacity oracle; then the cache's `used_blocks` must be
        what the live sequences need (None: not checked here), and each (seq_id, block
        positions, released positions) in `sequences` what the oracle counts."""
        for ev in events:
            self.capacity.apply(ev)
        if used_blocks is not None:
            self.capacity.check_used(used_blocks, where)
        for sid, num_blocks, released in sequences:
            self.capacity.check_sequence(sid, num_blocks, released, where)


class ManagerContractError(AssertionError):
    """The manager broke its API contract: a failed call changed it, its handles changed
    block ids without saying so, or its event log disagrees with its API."""


class CheckedManager:
    """Forwards to `manager` (which must be fresh) and checks every call; see the module."""

    def __init__(self, manager: KvCacheManager, *, repro: str = "") -> None:
        if manager.sequences or manager.stats().alloc_total_blocks:
            raise ValueError("CheckedManager: the manager must be fresh (nothing admitted "
                             "yet): the oracles must see every operation")
        cfg = manager.state.config
        self.manager = manager
        window = cfg.sliding_window
        self.oracles = CallOracles(cfg.tokens_per_block, cfg.max_num_blocks,
                                   block_reuse=cfg.block_reuse, sliding_window=window,
                                   repro=repro)
        self.shadow = self.oracles.shadow
        self.capacity = self.oracles.capacity
        self.num_operations = 0
        self._ids: dict[Hashable, tuple[list[int | None], int]] = {}  # block ids, version last seen
        self._log_seen = 0
        # id(plan) -> (plan, tokens, scope, first_chunk)
        self._plans: dict[int, tuple[AdmissionPlan, list[int], ReuseScope | None,
                                     int | None]] = {}
        self._queued: list[Move] = []  # the op queue after the last call

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    # -- the checked calls -------------------------------------------------------------

    def plan_admission(self, tokens: Sequence[int], scope: ReuseScope | None = None, *,
                       first_chunk: int | None = None) -> AdmissionPlan:
        """`KvCacheManager.plan_admission`; a plan that does not fit must be fair."""
        plan = self.manager.plan_admission(tokens, scope, first_chunk=first_chunk)
        toks = list(tokens)
        self._plans[id(plan)] = (plan, toks, scope, first_chunk)
        if not plan.fits and not plan.injected_fault:
            self.capacity.check_refusal(
                self.capacity.admission_need(toks, scope, num_cached=plan.num_cached_tokens,
                                             first_chunk=first_chunk),
                f"plan_admission({toks})")
        return plan

    def admit(self, seq_id: Hashable, plan: AdmissionPlan,
              priority: int | None = None) -> SequenceHandle:
        """`KvCacheManager.admit` (the manager's default priority unless given), checked."""
        known = self._plans.get(id(plan))
        need = chunk = None
        ours = known is not None and known[0] is plan  # else made elsewhere: chunk unknown
        if known is not None and ours:
            _, toks, scope, chunk = known
            need = self._admission_need(toks, scope, plan.num_cached_tokens, chunk)
        kw = {} if priority is None else {"priority": priority}
        return self._admitted(seq_id, f"admit({seq_id!r})",
                              lambda: self.manager.admit(seq_id, plan, **kw), need, chunk,
                              check_blocks=ours)

    def add_sequence(self, seq_id: Hashable, tokens: Sequence[int],
                     scope: ReuseScope | None = None,
                     priority: int | None = None) -> SequenceHandle:
        """`KvCacheManager.add_sequence` (the manager's default priority unless given),
        checked."""
        toks = list(tokens) if not isinstance(tokens, list) else tokens
        kw = {} if priority is None else {"priority": priority}
        cached = None
        if self.capacity.window_left is not None:  # its need depends on the match
            with contextlib.suppress(ValueError):  # bad input: add_sequence rejects it
                cached = self.manager.match_reuse(toks, scope).num_tokens
        return self._admitted(seq_id, f"add_sequence({seq_id!r}, {toks})",
                              lambda: self.manager.add_sequence(seq_id, toks, scope, **kw),
                              self._admission_need(toks, scope, cached, None), None)

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Take and apply the queued copies (the forward pass comes after them), then
        `KvCacheManager.commit`, checked. The copies are taken for a live `seq_id` even
        when the commit itself is then refused as bad input."""
        if self.manager.state.op_queue and seq_id in self.manager.sequences:
            self.take_copy_ops()
        where = f"commit({seq_id!r}, {num_tokens})"
        self._call(where, lambda: self.manager.commit(seq_id, num_tokens))
        seq = self.manager.sequences[seq_id]
        old, version = self._ids[seq_id]
        ids = list(seq.block_ids)
        released = seq.num_released_blocks
        # a window's release turns positions into None: no block switched there, but one
        # may have switched and then been released in the same commit
        moved = any(a != b for a, b in zip(old[released:], ids[released:], strict=True))
        bumped = seq.block_ids_version != version
        spurious = bumped and not moved and old[:released] == ids[:released]
        if (len(ids) != len(old) or any(b is not None for b in ids[:released])
                or (moved and not bumped) or spurious):
            raise ManagerContractError(
                f"{where}: block ids went from {old} to {ids} ({released} released) while "
                f"block_ids_version went from {version} to {seq.block_ids_version}: an "
                "engine's block table would go stale unnoticed")
        self._ids[seq_id] = (ids, seq.block_ids_version)
        switched = tuple(ids) if bumped else ()
        self._after(where, [Event("commit", seq_id, (), seq.num_committed_tokens, None,
                                  switched)])

    def append_tokens(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """`KvCacheManager.append_tokens`, checked (a refusal must be fair)."""
        where = f"append_tokens({seq_id!r}, {list(tokens)})"
        seq = self.manager.sequences.get(seq_id)
        need = None
        if seq is not None and seq_id in self._ids:
            need = self.capacity.append_need(seq_id, len(tokens))
        start = seq.num_tokens if seq is not None else 0
        self._call(where, lambda: self.manager.append_tokens(seq_id, tokens), need)
        seq = self.manager.sequences[seq_id]
        old, version = self._ids[seq_id]
        ids = list(seq.block_ids)
        if ids[:len(old)] != old or seq.block_ids_version != version:
            raise ManagerContractError(f"{where}: block ids went from {old} to {ids}; an "
                                       "append may only add blocks")
        self._ids[seq_id] = (ids, version)
        self._after(where, [Event("append", seq_id, tuple(seq.tokens[start:]), 0, None,
                                  tuple(ids[len(old):]))])

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int:
        """`KvCacheManager.reserve`, checked: it allocates every block the tokens lack when
        they are available, else all that are (none when the fault seam refuses), and
        returns the tokens its blocks cover."""
        where = f"reserve({seq_id!r}, {num_tokens})"
        grant = None
        if seq_id in self._ids and type(num_tokens) is int and num_tokens >= 0:
            grant = self.capacity.reserve_grant(seq_id, num_tokens)
        covered = self._call(where, lambda: self.manager.reserve(seq_id, num_tokens))
        seq = self.manager.sequences[seq_id]
        old, version = self._ids[seq_id]
        ids = list(seq.block_ids)
        new = ids[len(old):]
        faulted = not new and self.manager.state.allocation_fault is not None
        if (ids[:len(old)] != old or seq.block_ids_version != version
                or (len(new) != grant and not faulted)):
            raise ManagerContractError(f"{where}: block ids went from {old} to {ids}; it "
                                       f"should have added {grant} blocks")
        B = self.manager.state.config.tokens_per_block
        if covered != min(num_tokens, len(ids) * B):
            raise ManagerContractError(f"{where} returned {covered}; its {len(ids)} blocks "
                                       f"cover {min(num_tokens, len(ids) * B)} of those tokens")
        self._ids[seq_id] = (ids, version)
        self._after(where, [Event("append", seq_id, (), 0, None, tuple(new))] if new else [])
        return covered

    def free_sequence(self, seq_id: Hashable) -> None:
        """`KvCacheManager.free_sequence`, checked."""
        where = f"free_sequence({seq_id!r})"
        self._call(where, lambda: self.manager.free_sequence(seq_id))
        del self._ids[seq_id]
        self._after(where, [Event("free", seq_id)])

    def take_copy_ops(self) -> list[KvOp]:
        """`KvCacheManager.take_copy_ops`; the copies, offloads and onboards are applied
        to the shadow store."""
        queued = self._queue()
        ops = self.manager.take_copy_ops()
        if ops != [op for _, op in queued]:
            raise ManagerContractError(f"take_copy_ops() returned {ops}, the queue held "
                                       f"{queued}")
        self._applied("take_copy_ops()", queued)
        return ops

    def ack_copy_ops(self, num_applied: int) -> None:
        """`KvCacheManager.ack_copy_ops`: the first `num_applied` pending ops are applied
        to the shadow store; the rest must stay queued, in order. A refused count must
        change nothing."""
        where = f"ack_copy_ops({num_applied!r})"
        queued = self._queue()
        try:
            self.manager.ack_copy_ops(num_applied)
        except Exception as exc:
            if self._queue() != queued:
                raise ManagerContractError(f"{where} raised {type(exc).__name__} ({exc}) "
                                           "and changed the op queue") from exc
            raise
        left = self._queue()
        done = len(queued) - len(left)
        if done != num_applied or left != queued[done:]:
            raise ManagerContractError(f"{where}: the queue went from {queued} to {left}; "
                                       f"only its first {num_applied} ops may leave it")
        self._applied(where, queued[:done])

    def _applied(self, where: str, moved: list[tuple[Hashable, KvOp]]) -> None:
        """Check and apply the call that took `moved` ((owner, op), in order) off the queue."""
        events = []
        for owner, op in moved:
            kind, src, dst, n = self._move(op)
            events.append(Event(kind, _owner(owner), (), n, None, (src, dst)))  # type: ignore[arg-type]
        self._after(where, events)

    # -- whole-state checks ------------------------------------------------------------

    def check_oracles(self) -> None:
        """Both oracles on the state now (they already ran after every call)."""
        self.shadow.check_live(self._pending())
        self.capacity.check_used(self.manager.stats().used_num_blocks, "the last call")

    def check_integrity(self) -> None:
        """`KvCacheManager.check_integrity`."""
        self.manager.check_integrity()

    def leak_report(self) -> list[str]:
        """`KvCacheManager.leak_report`."""
        return self.manager.leak_report()

    # -- plumbing ----------------------------------------------------------------------

    def _admission_need(self, tokens: list[int], scope: ReuseScope | None,
                        num_cached: int | None, first_chunk: int | None) -> int | None:
        try:
            return self.capacity.admission_need(tokens, scope, num_cached=num_cached,
                                                first_chunk=first_chunk)
        except ValueError:
            return None  # bad input: the manager rejects it with its own message

    def _admitted(self, seq_id: Hashable, where: str, call: Callable[[], SequenceHandle],
                  need: int | None, first_chunk: int | None, *,
                  check_blocks: bool = True) -> SequenceHandle:
        """The admission `call`, checked; unless `check_blocks` (the first chunk is not
        known), its block positions must be those of `first_chunk`."""
        seq = self._call(where, call, need)
        ids = list(seq.block_ids)
        given = self.capacity.admission_blocks(seq.num_tokens, seq.num_cached_tokens,
                                               first_chunk)
        if check_blocks and len(ids) != given:
            raise ManagerContractError(f"{where}: admitted with {len(ids)} block positions "
                                       f"{ids}, not {given} (first chunk {first_chunk})")
        self._ids[seq_id] = (ids, seq.block_ids_version)
        self._after(where, [Event("admit", seq_id, tuple(seq.tokens), seq.num_cached_tokens,
                                  seq.scope, tuple(ids), seq.priority)])
        return seq

    def _call(self, where: str, call: Callable[[], T], need: int | None = None) -> T:
        self._plans.clear()  # any change makes every plan stale
        before = self._snapshot()
        try:
            return call()
        except Exception as exc:
            after = self._snapshot()
            if after != before:
                raise ManagerContractError(f"{where} raised {type(exc).__name__} ({exc}) "
                                           "and changed the cache") from exc
            refused = all(hasattr(exc, a) for a in ("needed", "available", "capacity"))
            if refused and need is not None and self.manager.state.allocation_fault is None:
                self.capacity.check_refusal(need, where)
            raise

    def _snapshot(self) -> tuple[object, ...]:
        m = self.manager
        return (m.stats(), m.state.tree.dump(), self._queue(),
                [(sid, list(s.block_ids), s.num_tokens, s.num_committed_tokens)
                 for sid, s in m.sequences.items()])

    def _queue(self) -> list[tuple[Hashable, KvOp]]:
        """(owner, op) for every queued op, in order: a copy of the manager's queue."""
        return list(self.manager.state.op_queue)

    def _pending(self) -> list[Move]:
        return [self._move(op) for op in self.manager.pending_copy_ops]

    def _move(self, op: Any) -> Move:
        """A queued op as (kind, src, dst, num_tokens), read by its class name (the
        harness does not import kvcache): an offload moves a whole block."""
        kind = _KINDS[type(op).__name__]
        n = getattr(op, "num_tokens", self.manager.state.config.tokens_per_block)
        return (kind, op.src, op.dst, n)

    def _after(self, where: str, events: list[Event]) -> None:
        events = [normalize_event(ev) for ev in events]
        pending = self._pending()
        taken = {(ev.kind, *ev.block_ids) for ev in events if ev.kind in MOVES}
        for kind, src, dst, n in self._queued:
            if (kind, src, dst, n) not in pending and (kind, src, dst) not in taken:
                self.shadow.note(("host", dst) if kind == "offload" else dst,
                                 f"{where}: queued {kind} of slots [0, {n}) from "
                                 f"{'host slot' if kind == 'onboard' else 'block'} {src} "
                                 "dropped, never applied")
        self._queued = pending
        self.oracles.provenance(events, pending)
        live = self.manager.sequences
        sequences = [(sid, len(live[sid].block_ids), live[sid].num_released_blocks)
                     for sid in {ev.seq_id for ev in events if ev.kind not in MOVES}
                     if sid in live]
        self.oracles.capacity_after(where, events, self.manager.stats().used_num_blocks,
                                    sequences)
        self._check_log(where, events)
        self.num_operations += 1

    def _check_log(self, where: str, events: list[Event]) -> None:
        log = self.manager.state.events
        if log is None:
            return
        recorded = [normalize_event(e) for e in log[self._log_seen:]]
        self._log_seen = len(log)
        if len(recorded) != len(events) or not all(map(_same, recorded, events)):
            raise ManagerContractError(f"{where}: the manager's event log recorded "
                                       f"{recorded}, its API says {events}")
