"""Capacity oracle: the blocks live sequences hold, and whether a refusal was fair.

From the same events as the other oracles (admit with its reused count, commit, append,
free; copies change no count) it keeps each live sequence's scope, tokens, valid count
(reused, then committed) and the block positions it was given. With block reuse on, a
full block whose KV is valid is cached and shared: live sequences of one scope holding
blocks that spell the same prefix hold one block between them. Under full attention a
sequence holds every position, one per `tokens_per_block` tokens (B), so

    needed = |{(scope, tokens[:(i + 1) * B]) : live s, first_s <= i < tree_s}|
             + sum over live s of (blocks_s - max(tree_s, first_s))

with tree_s = valid_s // B (0 without reuse), blocks_s = ceil(len_s / B) and first_s = 0;
without reuse every block is private.

Under a sliding window of W tokens (window_left = W - 1) the token at position p sees
positions p - window_left to p, and no later token sees further back (docs/design.md,
"Sliding windows"). The rule restated here, not imported:
- A sequence whose next token is at position v (its valid count) holds positions from
  first_s = max(0, v - window_left) // B on; with reuse it also keeps its deepest cached
  block, so first_s = min(that, max(tree_s - 1, 0)). The positions before are released:
  a private block goes back to the pool, a cached one stays in the tree unreferenced
  (evictable, or evicted into a hollow node), so neither counts.
- An admission is given the positions up to the end of its first chunk only
  (`first_chunk`, counted from its reused tokens); `reserve` adds positions, as many as
  the pool can give; an append, all the positions its tokens need or none. blocks_s is
  therefore the count the events report, which `admission_blocks` and `reserve_grant`
  predict for the caller to check first.

The cache's usedNumBlocks must equal `needed` after every operation (`check_used`). A
refusal is fair only when the blocks are not there: `capacity - needed` blocks are free
or evictable. Under full attention an admission needs ceil(L / B) of them less the
leading full blocks of its prompt (within the L - 1 cap) that live sequences of its scope
already hold. Under a window the cached blocks nobody holds count too (a match skips the
positions outside its window, however they were evicted), which this oracle does not
track: given the match the cache reports (n tokens, k = n // B full blocks), an admission
needs its new positions, up to the end of its first chunk, from k on, plus the matched
positions from first(n) to k that no live sequence holds (taking them makes them
unevictable). That is a lower bound: a copied partial block may also protect its source.
Where the match is only bounded from above (a model that lost track of evictions), the
need is the most over every match up to the bound: no match is not the most where a
first chunk counts from the match's end.
An append needs its new blocks; a reserve that gives fewer than asked must give all
`available`.
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
    blocks: int  # block positions given to it, released ones included


class CapacityOracle:
    """Counts the blocks live sequences hold (mutated by `apply`; checks only read).

    `sliding_window`: tokens a query sees, itself included (None: full attention).
    """

    def __init__(self, tokens_per_block: int, max_num_blocks: int, *,
                 block_reuse: bool = True, sliding_window: int | None = None,
                 repro: str = "") -> None:
        for name, value in (("tokens_per_block", tokens_per_block),
                            ("max_num_blocks", max_num_blocks),
                            ("sliding_window", 1 if sliding_window is None else sliding_window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CapacityOracle: {name} must be an int >= 1, got {value!r}")
        self.tokens_per_block = tokens_per_block
        self.max_num_blocks = max_num_blocks
        self.block_reuse = block_reuse
        self.window_left = None if sliding_window is None else sliding_window - 1
        self.repro = repro
        self._prefixes = Prefixes()
        self._live: dict[Hashable, _Live] = {}
        self._shared: Counter[int] = Counter()  # prefix id ending a held cached block -> holders
        self._private = 0  # blocks outside `_shared`, over all live sequences

    def apply(self, event: Event | Mapping[str, Any] | Any) -> None:
        """Apply one event. Under a window an admit's and a no-token append's (a reserve's)
        block ids say how many positions it was given. Raises ValueError for a malformed
        event, an unknown or duplicate seq_id, or a count outside the sequence or (window)
        beyond its blocks."""
        ev = normalize_event(event)
        if ev.kind in MOVES:
            return
        sid = ev.seq_id
        if ev.kind == "admit":
            if sid in self._live:
                raise ValueError(f"admit event for seq_id {sid!r}, which is already live")
            prefix = self._prefixes.extend(self._prefixes.root(ev.scope), ev.tokens)
            blocks = self._blocks(len(prefix))
            if self.window_left is not None and ev.block_ids:
                blocks = len(ev.block_ids)
            new = self._live[sid] = _Live(ev.scope, prefix, 0, 0)
            self._update(sid, new, ev.num_tokens, blocks)
            return
        seq = self._live.get(sid)
        if seq is None:
            raise ValueError(f"{ev.kind} event for seq_id {sid!r}, which is not live")
        if ev.kind == "commit":
            self._update(sid, seq, ev.num_tokens, seq.blocks)
        elif ev.kind == "append":
            last = seq.prefix[-1] if seq.prefix else self._prefixes.root(seq.scope)
            seq.prefix += self._prefixes.extend(last, ev.tokens)
            if not ev.tokens and self.window_left is not None:
                blocks = seq.blocks + len(ev.block_ids)  # reserved ahead of their compute
            else:
                blocks = max(seq.blocks, self._blocks(len(seq.prefix)))
            self._update(sid, seq, seq.valid, blocks)
        else:
            self._update(sid, seq, seq.valid, seq.blocks, freed=True)
            del self._live[sid]

    def _update(self, sid: Hashable, seq: _Live, valid: int, blocks: int, *,
                freed: bool = False) -> None:
        """Move `seq` to `valid` tokens and `blocks` positions (or, `freed`, to nothing),
        adjusting the held cached keys and the private count."""
        if not seq.valid <= valid <= len(seq.prefix):
            raise ValueError(f"seq_id {sid!r}: {valid} valid tokens must lie in "
                             f"[{seq.valid}, {len(seq.prefix)}]")
        B = self.tokens_per_block
        if self.window_left is not None and valid > blocks * B:
            raise ValueError(f"seq_id {sid!r}: {valid} valid tokens, but its {blocks} "
                             f"blocks hold only {blocks * B}")
        f0, t0 = self._held(seq.valid)
        self._private -= seq.blocks - max(t0, f0)
        if freed:
            f1 = t1 = t0  # nothing held: drop [f0, t0)
        else:
            f1, t1 = self._held(valid)
            self._private += blocks - max(t1, f1)
        for i in range(f0, min(t0, f1)):  # released (or freed)
            key = seq.prefix[(i + 1) * B - 1]
            self._shared[key] -= 1
            if not self._shared[key]:
                del self._shared[key]
        for i in range(max(t0, f1), t1):  # newly cached and held
            self._shared[seq.prefix[(i + 1) * B - 1]] += 1
        seq.valid, seq.blocks = valid, blocks

    def _held(self, valid: int) -> tuple[int, int]:
        """[first, tree): the cached positions a sequence with `valid` tokens holds."""
        tree = valid // self.tokens_per_block if self.block_reuse else 0
        return self.first_held(valid), tree

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # -- the window rule -----------------------------------------------------------------

    def first_held(self, valid: int) -> int:
        """The first position a sequence with `valid` valid tokens holds (0 under full
        attention): the window of its next token's, or its deepest cached block if that
        comes first."""
        if self.window_left is None:
            return 0
        B = self.tokens_per_block
        first = max(0, valid - self.window_left) // B
        return min(first, max(valid // B - 1, 0)) if self.block_reuse else first

    def admission_blocks(self, num_tokens: int, num_cached: int,
                         first_chunk: int | None) -> int:
        """Positions an admission of `num_tokens` reusing `num_cached` is given: all under
        full attention or without a first chunk, else to the end of that chunk."""
        if first_chunk is None or self.window_left is None:
            return self._blocks(num_tokens)
        return self._blocks(min(num_tokens, num_cached + first_chunk))

    def reserve_grant(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks `reserve(seq_id, num_tokens)` must allocate: those it lacks, as many as
        are available. ValueError for a seq_id that is not live."""
        seq = self._seq(seq_id)
        return max(0, min(self._blocks(num_tokens) - seq.blocks, self.available))

    def append_need(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """Blocks appending `num_new_tokens` to `seq_id` allocates (all or none)."""
        seq = self._seq(seq_id)
        return max(0, self._blocks(len(seq.prefix) + num_new_tokens) - seq.blocks)

    def _seq(self, seq_id: Hashable) -> _Live:
        seq = self._live.get(seq_id)
        if seq is None:
            raise ValueError(f"seq_id {seq_id!r} is not live")
        return seq

    # -- counts and checks ---------------------------------------------------------------

    @property
    def live(self) -> frozenset[Hashable]:
        """The seq_ids of the live sequences."""
        return frozenset(self._live)

    @property
    def needed(self) -> int:
        """Blocks the live sequences hold now."""
        return len(self._shared) + self._private

    @property
    def available(self) -> int:
        """Blocks that must be free or evictable now."""
        return self.max_num_blocks - self.needed

    def admission_need(self, tokens: Sequence[int], scope: Any = None, *,
                       num_cached: int | None = None, first_chunk: int | None = None,
                       unreused_tail: int = 1, match_known: bool = True) -> int:
        """Blocks an admission of `tokens` in `scope` takes from the available ones (at
        least). Full attention: all it occupies but the leading full blocks live
        sequences already hold (a lookup reaches all but the last `unreused_tail`
        tokens). Sliding window: the positions from its match's k full blocks to the end
        of `first_chunk`, plus the matched ones inside its window that no live sequence
        holds; `num_cached` (the match the cache reports) is required. Unless
        `match_known`, `num_cached` only bounds the match from above (a model that lost
        track of evictions): the most need over every match up to it, so that a refusal
        is found unfair only where any of them would have fitted (no match is not the
        most need: a longer one moves a first chunk's end further on and takes its
        unheld blocks from the evictable ones). Raises ValueError for a window's missing
        or out-of-range `num_cached`; changes nothing."""
        n = len(tokens)
        B = self.tokens_per_block
        if self.window_left is not None:
            if num_cached is None or not 0 <= num_cached < max(n, 1):
                raise ValueError(f"admission_need under a window: num_cached must lie in "
                                 f"[0, {n}), got {num_cached!r}")
            top = num_cached // B if self.block_reuse else 0
            root = self._prefixes.root(normalize_scope(scope, "scope"))
            prefix = self._prefixes.extend(root, tokens[:top * B])
            unheld = [0]  # unheld[i]: matched blocks before position i no live seq holds
            for i in range(top):
                unheld.append(unheld[-1] + (prefix[(i + 1) * B - 1] not in self._shared))

            def need_at(cached: int) -> int:
                k = cached // B if self.block_reuse else 0
                first = min(self.first_held(cached), k)
                return self.admission_blocks(n, cached, first_chunk) - k \
                    + unheld[k] - unheld[first]

            return need_at(num_cached) if match_known \
                else max(need_at(c) for c in range(num_cached + 1))
        need = self._blocks(n)
        reach = n - unreused_tail
        if not self.block_reuse or reach < 1:
            return need
        prefix = self._prefixes.extend(self._prefixes.root(normalize_scope(scope, "scope")),
                                       tokens[:reach // B * B])
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

    def check_sequence(self, seq_id: Hashable, num_blocks: int, released: int,
                       where: str) -> None:
        """Raise CapacityError unless the live `seq_id` has `num_blocks` positions of which
        the first `released` are released, as the oracle counts them."""
        seq = self._seq(seq_id)
        first = self.first_held(seq.valid)
        if (num_blocks, released) != (seq.blocks, first):
            self._fail(f"capacity: after {where}, sequence {seq_id!r} (valid {seq.valid} of "
                       f"{len(seq.prefix)} tokens) has other block positions",
                       f"{seq.blocks} positions, the first {first} released",
                       f"{num_blocks} positions, the first {released} released")

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
