"""Capacity oracle: the blocks live sequences need, and whether a refusal was fair.

From the same events as the other oracles (admit with its reused count, commit, append,
free; copies change no count) it keeps each live sequence's scope, tokens and valid
count (reused, then committed). A live sequence needs one block per `tokens_per_block`
tokens. With block reuse on, a full block whose KV is valid is cached and shared: live
sequences of one scope whose valid full blocks spell the same prefix hold one block
between them. So

    needed = |{(scope, tokens[:(i + 1) * B]) : live s, i < valid_s // B}|
             + sum over live s of (ceil(len_s / B) - valid_s // B)

and without reuse every block is private. The cache's usedNumBlocks must equal `needed`
after every operation (`check_used`). A refusal is fair only when the blocks are not
there: `capacity - needed` blocks are free or evictable, and an admission needs
ceil(L / B) of them less the leading full blocks of its prompt (within the L - 1 cap)
that live sequences of its scope already hold; an append needs its new blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.oracle.prefixes import Prefixes
from harness.oracle.types import MOVES, Event, normalize_event, normalize_scope


class CapacityError(AssertionError):
    """The cache holds more or fewer blocks than its live sequences need, or refused
    blocks that were there; the message gives expected vs actual."""


@dataclass
class _Live:
    scope: Hashable
    prefix: list[int]  # prefix id of every token
    valid: int


class CapacityOracle:
    """Counts the blocks live sequences need (mutated by `apply`; checks only read)."""

    def __init__(self, tokens_per_block: int, max_num_blocks: int, *,
                 block_reuse: bool = True, repro: str = "") -> None:
        for name, value in (("tokens_per_block", tokens_per_block),
                            ("max_num_blocks", max_num_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CapacityOracle: {name} must be an int >= 1, got {value!r}")
        self.tokens_per_block = tokens_per_block
        self.max_num_blocks = max_num_blocks
        self.block_reuse = block_reuse
        self.repro = repro
        self._prefixes = Prefixes()
        self._live: dict[Hashable, _Live] = {}
        self._shared: Counter[int] = Counter()  # prefix id ending a valid full block -> holders
        self._private = 0  # blocks outside `_shared`, over all live sequences

    def apply(self, event: Event | Mapping[str, Any] | Any) -> None:
        """Apply one event. Raises ValueError for a malformed event, an unknown or
        duplicate seq_id, or a count outside the sequence."""
        ev = normalize_event(event)
        if ev.kind in MOVES:
            return
        sid = ev.seq_id
        if ev.kind == "admit":
            if sid in self._live:
                raise ValueError(f"admit event for seq_id {sid!r}, which is already live")
            prefix = self._prefixes.extend(self._prefixes.root(ev.scope), ev.tokens)
            new = self._live[sid] = _Live(ev.scope, prefix, 0)
            self._private += self._blocks(len(prefix))
            self._validate(sid, new, ev.num_tokens)
            return
        seq = self._live.get(sid)
        if seq is None:
            raise ValueError(f"{ev.kind} event for seq_id {sid!r}, which is not live")
        if ev.kind == "commit":
            self._validate(sid, seq, ev.num_tokens)
        elif ev.kind == "append":
            before = self._blocks(len(seq.prefix))
            last = seq.prefix[-1] if seq.prefix else self._prefixes.root(seq.scope)
            seq.prefix += self._prefixes.extend(last, ev.tokens)
            self._private += self._blocks(len(seq.prefix)) - before
        else:
            full = seq.valid // self.tokens_per_block if self.block_reuse else 0
            for i in range(full):
                self._drop(seq.prefix[(i + 1) * self.tokens_per_block - 1])
            self._private -= self._blocks(len(seq.prefix)) - full
            del self._live[sid]

    def _validate(self, sid: Hashable, seq: _Live, n: int) -> None:
        if not seq.valid <= n <= len(seq.prefix):
            raise ValueError(f"seq_id {sid!r}: {n} valid tokens must lie in "
                             f"[{seq.valid}, {len(seq.prefix)}]")
        B = self.tokens_per_block
        if self.block_reuse:
            for i in range(seq.valid // B, n // B):  # private blocks join the shared set
                self._shared[seq.prefix[(i + 1) * B - 1]] += 1
                self._private -= 1
        seq.valid = n

    def _drop(self, key: int) -> None:
        self._shared[key] -= 1
        if not self._shared[key]:
            del self._shared[key]

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # -- counts and checks ---------------------------------------------------------------

    @property
    def needed(self) -> int:
        """Blocks the live sequences need now."""
        return len(self._shared) + self._private

    @property
    def available(self) -> int:
        """Blocks that must be free or evictable now."""
        return self.max_num_blocks - self.needed

    def admission_need(self, tokens: Sequence[int], scope: Any = None) -> int:
        """Blocks an admission of `tokens` in `scope` takes from the available ones: all it
        occupies but the leading full blocks live sequences already hold."""
        n = len(tokens)
        need = self._blocks(n)
        if not self.block_reuse or n < 2:
            return need
        B = self.tokens_per_block
        prefix = self._prefixes.extend(self._prefixes.root(normalize_scope(scope, "scope")),
                                       tokens[:(n - 1) // B * B])
        held = 0
        while (held + 1) * B <= len(prefix) and prefix[(held + 1) * B - 1] in self._shared:
            held += 1
        return need - held

    def check_used(self, used: int, where: str) -> None:
        """Raise CapacityError unless `used` (the cache's usedNumBlocks) equals `needed`."""
        if used != self.needed:
            self._fail(f"capacity: after {where}, usedNumBlocks differs from what the live "
                       "sequences need",
                       f"{self.needed} ({len(self._shared)} held in the cache, "
                       f"{self._private} private)", str(used))

    def check_refusal(self, need: int, where: str) -> None:
        """Raise CapacityError if a request for `need` blocks was refused although
        `available` blocks are there."""
        if need <= self.available:
            self._fail(f"capacity: {where} was refused although its blocks are there",
                       f"admitted: needs {need}, {self.available} of {self.max_num_blocks} "
                       "free or evictable", "OutOfBlocksError")

    def _fail(self, head: str, expected: str, actual: str) -> None:
        lines = [head, f"  expected  {expected}", f"  actual    {actual}"]
        if self.repro:
            lines.append(self.repro)
        raise CapacityError("\n".join(lines))
