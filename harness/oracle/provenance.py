"""Provenance oracle: a shadow KV store that knows which tokens' KV each block holds.

Kept from the cache's operations alone, never from its internals: admissions with their
block ids and reused count, commits, appends, frees and the copies the engine applied
(`harness.oracle.types.Event`). A slot of a physical block holds the KV of one token in
context, its scope and every token up to it (`Prefixes`), or nothing until written.
Content outlives frees and evictions, as real KV does: a block holds what was last
written into it, whoever holds it now.

- A commit is a forward pass: it first *reads* every position the sequence already had
  (its reused and earlier committed tokens, through its blocks as they were), then
  *writes* the positions it computed. Every read must find the reader's own prefix in its
  own scope; anything else raises `ProvenanceError`, naming the block, what it holds,
  what the request needed and the block's recent history.
- A copy writes its target's first slots from its source (`KvStorage.apply_copies`).
  With a host tier an offload writes a host slot (a store of its own) from a device
  block, whole, and an onboard a device block's first slots from a host slot.
- Given the copies queued and not yet applied (`pending`: copies, offloads, onboards, in
  order), an admission is checked at once: each reused slot must hold the right KV now or
  receive it from the queue, since the queue is applied before the next forward pass;
  `check_live` checks every live sequence so. Replaying a log without that queue, the
  first read catches the same faults.
- Under a sliding window of W tokens a forward pass from position p reads only
  positions p - W + 1 on: the blocks before may be released (None in the log) and hold
  anything. Blocks then come as chunks need them (appends of no tokens).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.oracle.prefixes import Prefixes
from harness.oracle.types import Event, normalize_event

Copy = tuple[int, int, int]  # (src, dst, num_tokens) of a queued device copy
# (kind, src, dst, num_tokens): "copy", "offload" (device block -> host slot) or
# "onboard" (host slot -> device block); a bare Copy is a "copy"
Move = tuple[str, int, int, int]
Queued = Copy | Move
HISTORY = 16  # events remembered per block
_ROWS = 8  # differing slots shown per violation


class ProvenanceError(AssertionError):
    """A request reads (or would read) KV that is not its own; the message has the
    evidence: the slots, what they hold, what was needed, each block's history."""


@dataclass
class _Live:
    """A live sequence as the shadow store sees it."""

    scope: Hashable
    prefix: list[int]  # the prefix id of every token
    blocks: list[int | None]  # None: released by a sliding window
    valid: int  # positions whose KV is valid: reused at admission, then committed


class ShadowStore:
    """The shadow KV store and its checks. `apply` mutates it; the checks only read."""

    def __init__(self, tokens_per_block: int, *, repro: str = "",
                 sliding_window: int | None = None) -> None:
        if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) \
                or tokens_per_block < 1:
            raise ValueError(f"ShadowStore: tokens_per_block must be an int >= 1, "
                             f"got {tokens_per_block!r}")
        self.tokens_per_block = tokens_per_block
        # window_left: a pass from position p reads p - window_left on (None: from 0)
        self.window_left = None if sliding_window is None else sliding_window - 1
        self.prefixes = Prefixes()
        self.repro = repro  # a line that reproduces the run, appended to every violation
        self.num_events = 0
        self.num_slots_checked = 0
        self._slots: dict[int, list[int | None]] = {}
        self._host: dict[int, list[int | None]] = {}  # host slot -> its tokens' KV
        self._history: dict[Hashable, deque[str]] = {}  # block, or ("host", slot)
        self._live: dict[Hashable, _Live] = {}

    # -- events ------------------------------------------------------------------------

    def apply(self, event: Event | Mapping[str, Any] | Any,
              pending: Sequence[Queued] | None = None) -> None:
        """Apply one event; with `pending`, the copies queued after it (in order), an
        admission's reuse is checked at once.

        Raises ProvenanceError for a read of KV that is not the reader's, ValueError for a
        malformed event, an unknown or duplicate seq_id, or block ids that do not cover
        the tokens (a log that does not record block ids).
        """
        ev = normalize_event(event)
        self.num_events += 1
        if ev.kind == "copy":
            self._copy(ev)
        elif ev.kind in ("offload", "onboard"):
            self._move(ev)
        elif ev.kind == "admit":
            self._admit(ev, pending)
        else:
            seq = self._live.get(ev.seq_id)
            if seq is None:
                raise ValueError(f"{ev.kind} event for seq_id {ev.seq_id!r}, which is not live")
            if ev.kind == "commit":
                self._commit(ev, seq)
            elif ev.kind == "append":
                self._append(ev, seq)
            else:
                self._free(ev, seq)

    def replay(self, events: Iterable[Event | Mapping[str, Any] | Any]) -> None:
        """Apply every event in order (reads are checked as they happen)."""
        for event in events:
            self.apply(event)

    def _admit(self, ev: Event, pending: Sequence[Queued] | None) -> None:
        sid = ev.seq_id
        if sid in self._live:
            raise ValueError(f"admit event for seq_id {sid!r}, which is already live")
        self._check_blocks(ev, len(ev.tokens), len(ev.block_ids))
        if ev.num_tokens > len(ev.tokens):
            raise ValueError(f"admit event for seq_id {sid!r}: {ev.num_tokens} tokens "
                             f"reused of a {len(ev.tokens)}-token prompt")
        prefix = self.prefixes.extend(self.prefixes.root(ev.scope), ev.tokens)
        seq = self._live[sid] = _Live(ev.scope, prefix, list(ev.block_ids), ev.num_tokens)
        B = self.tokens_per_block
        for i, block in enumerate(seq.blocks):
            reused = min(max(seq.valid - i * B, 0), B)
            if block is not None:
                self.note(block, f"admit {sid!r}: position {i}"
                          + (f", reuses slots [0, {reused})" if reused else ""))
        if pending is not None:
            for kind, src, dst, n in map(_move, pending):
                if kind != "offload" and dst in seq.blocks:
                    origin = f"host slot {src}" if kind == "onboard" else f"block {src}"
                    self.note(dst, f"{kind} of slots [0, {n}) from {origin} queued")
            self._check(sid, seq, seq.valid, pending, f"admission of {sid!r} reuses")

    def _commit(self, ev: Event, seq: _Live) -> None:
        sid, n = ev.seq_id, ev.num_tokens
        if not seq.valid <= n <= len(seq.prefix):
            raise ValueError(f"commit event of {n} tokens for seq_id {sid!r}: must lie in "
                             f"[{seq.valid}, {len(seq.prefix)}]")
        self._check(sid, seq, seq.valid, (), f"commit {sid!r} (a forward pass) reads")
        B = self.tokens_per_block
        for i in range(seq.valid // B, -(-n // B)):
            lo, hi = max(seq.valid, i * B), min(n, (i + 1) * B)
            block = seq.blocks[i] if i < len(seq.blocks) else None
            if block is None:
                raise ValueError(f"commit event of {n} tokens for seq_id {sid!r}: no block "
                                 f"recorded for position {i}, which it writes")
            slots = self._slots.setdefault(block, [None] * B)
            slots[lo - i * B:hi - i * B] = seq.prefix[lo:hi]
            self.note(block, f"commit {sid!r}: writes slots [{lo - i * B}, {hi - i * B}) "
                       f"as position {i}")
        seq.valid = n
        if ev.block_ids:
            self._switch(ev, seq)

    def _switch(self, ev: Event, seq: _Live) -> None:
        if len(ev.block_ids) != len(seq.blocks):
            raise ValueError(f"commit event for seq_id {ev.seq_id!r}: {len(ev.block_ids)} "
                             f"block ids for a sequence of {len(seq.blocks)} blocks")
        for i, (old, new) in enumerate(zip(seq.blocks, ev.block_ids, strict=True)):
            if old != new and old is not None and new is not None:
                self.note(old, f"commit {ev.seq_id!r}: position {i} leaves for block {new}")
                self.note(new, f"commit {ev.seq_id!r}: position {i} switches here from "
                           f"block {old}")
        seq.blocks = list(ev.block_ids)
        self._check(ev.seq_id, seq, seq.valid, (), f"commit {ev.seq_id!r} switched blocks: "
                    "its next forward pass reads")

    def _append(self, ev: Event, seq: _Live) -> None:
        last = seq.prefix[-1] if seq.prefix else self.prefixes.root(seq.scope)
        seq.prefix += self.prefixes.extend(last, ev.tokens)
        for block in ev.block_ids:
            if block is not None:
                self.note(block, f"append {ev.seq_id!r}: position {len(seq.blocks)}")
            seq.blocks.append(block)
        self._check_blocks(ev, len(seq.prefix), len(seq.blocks))

    def _free(self, ev: Event, seq: _Live) -> None:
        for i, block in enumerate(seq.blocks):
            if block is not None:
                self.note(block, f"free {ev.seq_id!r} (position {i})")
        del self._live[ev.seq_id]

    def _copy(self, ev: Event) -> None:
        src, dst = ev.block_ids
        assert src is not None and dst is not None  # normalize_event checked it
        n = ev.num_tokens
        B = self.tokens_per_block
        if not 0 < n <= B or src == dst:
            raise ValueError(f"copy event {ev}: copies 1 to {B} slots between two blocks")
        have = self._slots.get(src, [None] * B)[:n]
        self._slots.setdefault(dst, [None] * B)[:n] = have
        self.note(src, f"copy of slots [0, {n}) to block {dst} (queued by {ev.seq_id!r})")
        self.note(dst, f"copy of slots [0, {n}) from block {src} (queued by {ev.seq_id!r})")

    def _move(self, ev: Event) -> None:
        src, dst = ev.block_ids
        assert src is not None and dst is not None  # normalize_event refuses None here
        n = ev.num_tokens
        B = self.tokens_per_block
        if not 0 < n <= B or (ev.kind == "offload" and n != B):
            raise ValueError(f"{ev.kind} event {ev}: moves 1 to {B} slots (an offload all {B})")
        if ev.kind == "offload":
            self._host[dst] = self._slots.get(src, [None] * B)[:]
            self.note(src, f"offload to host slot {dst} (by {ev.seq_id!r})")
            self.note(("host", dst), f"offload from block {src} (by {ev.seq_id!r})")
        else:
            self._slots.setdefault(dst, [None] * B)[:n] = self._host.get(src, [None] * B)[:n]
            self.note(("host", src), f"onboard of slots [0, {n}) to block {dst} "
                      f"(by {ev.seq_id!r})")
            self.note(dst, f"onboard of slots [0, {n}) from host slot {src} "
                      f"(by {ev.seq_id!r})")

    def _check_blocks(self, ev: Event, num_tokens: int, num_blocks: int) -> None:
        need = -(-num_tokens // self.tokens_per_block)
        # under a sliding window blocks come as chunks need them: fewer is fine
        if num_blocks > need or (num_blocks < need and self.window_left is None):
            raise ValueError(f"{ev.kind} event for seq_id {ev.seq_id!r}: {num_blocks} blocks "
                             f"for {num_tokens} tokens of {self.tokens_per_block} a block "
                             "(does this log record block ids?)")

    def note(self, block: Hashable, text: str) -> None:
        """Add `text` to `block`'s history (a device block id, or ("host", slot)), under
        the latest event (a caller that sees more than the events, such as a copy
        dropped from the queue, says so here)."""
        hist = self._history.get(block)
        if hist is None:
            hist = self._history[block] = deque(maxlen=HISTORY)
        hist.append(f"#{self.num_events} {text}")

    # -- checks ------------------------------------------------------------------------

    def check_live(self, pending: Sequence[Queued] = ()) -> None:
        """Every live sequence's valid positions hold its own KV, or will once the queued
        copies `pending` are applied. Raises ProvenanceError otherwise; changes nothing."""
        for sid, seq in self._live.items():
            self._check(sid, seq, seq.valid, pending, f"live sequence {sid!r} would read")

    def holds(self, block: int, slot: int) -> str:
        """What the slot holds, in words (for messages and tests)."""
        slots = self._slots.get(block)
        return self.prefixes.describe(slots[slot] if slots else None)

    def _check(self, sid: Hashable, seq: _Live, end: int, pending: Sequence[Queued],
               what: str) -> None:
        B = self.tokens_per_block
        over = self._overlay(pending) if pending else {}
        bad: list[tuple[int, int, int, int | None]] = []  # position, block, slot, held
        start = 0 if self.window_left is None else max(0, end - self.window_left)
        for i in range(start // B, -(-end // B)):
            lo, hi = max(start - i * B, 0), min(end, (i + 1) * B) - i * B
            block = seq.blocks[i]
            if block is None:
                raise ValueError(f"{what}: position {i} of {sid!r} is released, yet its "
                                 f"window (from position {start}) reads it")
            want = seq.prefix[i * B + lo:i * B + hi]
            held = self._slots.get(block)
            have = held[lo:hi] if held is not None else [None] * (hi - lo)
            if over:
                have = [over.get((block, lo + s), h) for s, h in enumerate(have)]
            if have != want:
                bad += [(i * B + lo + s, block, lo + s, h) for s, h in enumerate(have)
                        if h != want[s]]
        self.num_slots_checked += end - start
        if bad:
            raise ProvenanceError(self._message(sid, seq, bad, what, bool(pending)))

    def _overlay(self, pending: Sequence[Queued]) -> dict[tuple[int, int], int | None]:
        """(block, slot) -> content once the queue is applied, in order (through the host
        slots its offloads write and its onboards read)."""
        over: dict[tuple[int, int], int | None] = {}
        host: dict[tuple[int, int], int | None] = {}
        for kind, src, dst, n in map(_move, pending):
            if kind == "onboard":
                held = self._host.get(src)
                for s in range(n):
                    over[(dst, s)] = host.get((src, s), held[s] if held is not None else None)
                continue
            held = self._slots.get(src)
            into = host if kind == "offload" else over
            for s in range(self.tokens_per_block if kind == "offload" else n):
                into[(dst, s)] = over.get((src, s), held[s] if held is not None else None)
        return over

    def _message(self, sid: Hashable, seq: _Live, bad: list[tuple[int, int, int, int | None]],
                 what: str, pending: bool) -> str:
        desc = self.prefixes.describe
        rows = [("position", "block", "slot", "expected", "actual")] + [
            (str(p), str(b), str(s), desc(seq.prefix[p]), desc(h)) for p, b, s, h in bad[:_ROWS]]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        table = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                 for r in rows]
        after = " (queued copies applied)" if pending else ""
        lines = [f"provenance violation at event #{self.num_events}: {what} KV that is not "
                 f"its own: {len(bad)} of {seq.valid} slots differ{after}", *table]
        if len(bad) > _ROWS:
            lines.append(f"  ({len(bad) - _ROWS} more)")
        if self.repro:
            lines.append(self.repro)
        for block in dict.fromkeys(b for _, b, _, _ in bad[:_ROWS]):
            lines.append(f"block {block} history (last {HISTORY} events):")
            lines += [f"  {h}" for h in self._history.get(block, ["(no events)"])]
        return "\n".join(lines)


def _move(queued: Queued) -> Move:
    """A queued entry as (kind, src, dst, num_tokens) (a bare Copy is a "copy")."""
    if len(queued) == 3:
        src, dst, n = queued
        return ("copy", src, dst, n)
    return queued
