"""An independent expected-reuse model: replays admissions, commits, appends and frees.

Written deliberately unlike `kvcache.core.radix` (it imports nothing from `kvcache`): a cached
full block is a dict key `(scope, every token of the prefix through the block)`, a cached
partial leaf is `(scope, prefix tokens, tail tokens)`, and "in use" is a count of live
sequences per full-block key. It follows the reuse rules of docs/design.md to the letter.

Sliding window (`OracleConfig.sliding_window` = W): a live sequence about to compute
position p holds only its blocks from (p - W + 1) // B on (and always its deepest
cached one); a commit releases the rest. A match needs only the blocks in the window of
its first new token. Nothing is evicted here, so a cached block's whole prefix is cached
and the longest match is the walk's: the window decides which blocks a sequence holds,
and so which leaves are unused (claimable). With a bounded pool the cache matches the
same as long as the blocks inside that window survive, however much of the prefix was
evicted.

Exact with an unbounded pool. Given the pool sizes (`OracleConfig.max_num_blocks`, and
`host_cache_blocks` for a host tier; full attention only) it also models eviction,
offload, onboard and drop, block by block (`harness.oracle.tiers`, which says when that is
exact). Without them, a bounded pool makes it an upper bound when partial reuse is off:
eviction only removes blocks. With partial reuse on it is not strictly one:
evicting a block's followers makes it an unused leaf, so a request may *claim* it where
the model (which evicts nothing) says the block is not claimable. With
copy_on_partial_reuse off that happens readily (the model predicts no partial hit at
all; e.g. B=3, a pool of 4 blocks); with it on only through rare ties between candidates.
Under pool pressure the cache also serves a hit the model predicts as a copy by claiming
the source once its followers are evicted (the same tokens reused, counted as a claim).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from harness.oracle.tiers import Tiers
from harness.oracle.types import (
    MOVES,
    CachedBlock,
    Event,
    OracleConfig,
    OraclePrediction,
    RequestReuse,
    normalize_event,
    normalize_scope,
)

Tokens = tuple[int, ...]
FullKey = tuple[Hashable, Tokens]            # (scope, tokens [0, (i + 1) * B))
PartialKey = tuple[Hashable, Tokens, Tokens]  # (scope, tokens [0, i * B), tail)
ParentKey = tuple[Hashable, Tokens]           # (scope, tokens [0, i * B))


@dataclass
class _Seq:
    """A live sequence: its tokens, committed count, cached blocks and retention priority."""

    scope: Hashable
    tokens: list[int]
    committed: int
    keys: list[FullKey]  # keys[i] is its cached block at position i; contiguous from 0
    priority: int
    first: int = 0  # it holds keys[first:]; the window released the ones before


@dataclass(frozen=True)
class _Match:
    """What an admission would reuse now; `source` is the partial winner, if any."""

    full_keys: tuple[FullKey, ...]
    partial_tokens: int
    source: FullKey | PartialKey | None
    claim: bool


class ReuseOracle:
    """Replays cache events and predicts reuse per admission (mutates only itself)."""

    def __init__(self, cfg: OracleConfig) -> None:
        self.cfg = cfg
        # every cached block -> when it was cached (ties between equally short claimable
        # blocks go to the most recently cached one, as in the cache;
        # docs/design.md#choosing-the-partial-block)
        self._cached: dict[FullKey | PartialKey, int] = {}
        self._clock = 0
        # children of a prefix: the cached full blocks and partial leaves right after it
        self._children: defaultdict[ParentKey, set[FullKey | PartialKey]] = defaultdict(set)
        self._users: Counter[FullKey] = Counter()
        self._seqs: dict[Hashable, _Seq] = {}
        self._admissions: list[RequestReuse] = []
        self._tiers: Tiers | None = None  # bounded pools, when their sizes are known
        if cfg.max_num_blocks is not None:
            self._tiers = Tiers(cfg.max_num_blocks, cfg.host_cache_blocks,
                                lambda k: self._children.get(k, ()),
                                lambda k: self._users[k] > 0, self._uncache)

    # -- queries -----------------------------------------------------------------------

    def probe(self, tokens: Sequence[int], scope: Any = None) -> int:
        """Tokens an admission of `tokens` would reuse now; changes nothing."""
        match = self._match(tuple(tokens), normalize_scope(scope, "probe"))
        return len(match.full_keys) * self.cfg.tokens_per_block + match.partial_tokens

    def cached_blocks(self) -> dict[tuple[Hashable, Tokens], CachedBlock]:
        """Every cached block, keyed by (scope, the tokens from the sequence's start to
        the block's end: a partial leaf's end where its tail does), with its tier, its
        retention priority and, unless a live sequence holds it, when it was last
        released: what decides the next eviction. A new dict; changes nothing. Raises
        ValueError unless the pools are modelled (`OracleConfig.max_num_blocks`)."""
        tiers = self._tiers
        if tiers is None:
            raise ValueError("cached_blocks: the oracle models no pools (give "
                             "OracleConfig.max_num_blocks)")
        out: dict[tuple[Hashable, Tokens], CachedBlock] = {}
        for name, tier in (("device", tiers.device), ("host", tiers.host)):
            for key, (priority, time) in tier.items():
                held = len(key) == 2 and self._users[key] > 0
                tokens = key[1] if len(key) == 2 else key[1] + key[2]
                out[(key[0], tokens)] = CachedBlock(name, priority,  # type: ignore[arg-type]
                                                    None if held else time)
        return out

    def prediction(self) -> OraclePrediction:
        """Every admission so far, per request and in total (with the allocations and
        the moves between tiers when the pools are modelled)."""
        t = self._tiers
        if t is None:
            return OraclePrediction.from_admissions(self._admissions)
        return OraclePrediction.from_admissions(
            self._admissions, (t.evicted, t.offloaded, t.onboarded, t.dropped),
            (t.alloc_total, t.alloc_new, t.decode_alloc))

    def scopes_caching(self, tokens: Sequence[int]) -> list[Hashable]:
        """The scopes (as the log names them, normalized) in which the full block ending
        at `tokens` is cached: none, one, or several where two scopes computed the same
        tokens. Changes nothing."""
        want = tuple(tokens)
        return [key[0] for key in self._cached if len(key) == 2 and key[1] == want]

    def forget(self, scope: Any, tokens: Sequence[int]) -> bool:
        """The cache dropped its full block ending at `tokens` (in `scope`, as the log
        names scopes), which no live sequence holds: later matches stop before it. For
        a caller that knows the engine's evictions (its contract's order); returns
        whether the block was cached. Raises ValueError for a held block."""
        key = (normalize_scope(scope, "forget"), tuple(tokens))
        if key not in self._cached:
            return False
        if self._users[key]:
            raise ValueError(f"forget: block {key} is held by a live sequence")
        self._uncache(key)
        return True

    # -- events ------------------------------------------------------------------------

    def apply(self, event: Event | Mapping[str, Any] | Any) -> RequestReuse | None:
        """Apply one event; returns the admission's prediction for "admit", else None.

        Raises ValueError for a malformed event, an unknown or duplicate seq_id, or a
        commit that goes backwards or past the sequence's tokens.
        """
        ev = normalize_event(event)
        if ev.kind in MOVES:
            return None  # KV movement: no effect on what is cached or reused
        if ev.kind == "admit":
            assert ev.priority is not None  # normalize_event gives every admit one
            return self._admit(ev.seq_id, ev.tokens, ev.scope, ev.priority)
        seq = self._seqs.get(ev.seq_id)
        if seq is None:
            raise ValueError(f"{ev.kind} event for seq_id {ev.seq_id!r}, which is not live")
        if ev.kind == "append":
            before = self._blocks(seq)
            seq.tokens.extend(ev.tokens)
            if self._tiers is not None:
                self._tiers.append(self._blocks(seq) - before)
        elif ev.kind == "commit":
            self._commit(ev.seq_id, seq, ev.num_tokens)
        else:
            self._free(ev.seq_id, seq)
        return None

    def replay(self, events: Iterable[Event | Mapping[str, Any] | Any]) -> OraclePrediction:
        """Apply every event in order; returns the prediction so far."""
        for event in events:
            self.apply(event)
        return self.prediction()

    # -- the rules ---------------------------------------------------------------------

    def _match(self, prompt: Tokens, scope: Hashable) -> _Match:
        B = self.cfg.tokens_per_block
        if not self.cfg.enable_block_reuse or not prompt:
            return _Match((), 0, None, False)
        limit = len(prompt) - self.cfg.unreused_tail  # the last token(s) are never reused
        hits: list[FullKey] = []
        while (len(hits) + 1) * B <= limit:
            key = (scope, prompt[: (len(hits) + 1) * B])
            if key not in self._cached:
                break
            hits.append(key)
        align = self.cfg.reuse_alignment_blocks
        if align > 1:  # hybrid models resume only from state snapshots at these blocks
            del hits[len(hits) - len(hits) % align:]
            return _Match(tuple(hits), 0, None, False)
        start = len(hits) * B
        remaining = limit - start
        if not self.cfg.enable_partial_reuse or remaining == 0:
            return _Match(tuple(hits), 0, None, False)
        wanted = prompt[start : start + min(remaining, B)]
        # (shared, claimable, -tokens a claim takes out of the cache, the stamp of a
        # claim, less that of a copy): max wins, so of equal claims the most recently
        # cached, of equal copy sources the first cached (its admission touches it,
        # which a bounded pool's eviction order sees; docs/design.md)
        best: tuple[int, bool, int, int] | None = None
        source: FullKey | PartialKey | None = None
        for cand in self._children.get((scope, prompt[:start]), ()):
            block = cand[1][start:] if len(cand) == 2 else cand[2]
            claimable = self._unused_leaf(cand)
            if not (claimable or self.cfg.copy_on_partial_reuse):
                continue
            shared = _common_prefix(block, wanted)
            stamp = self._cached[cand]
            rank = (shared, claimable, -len(block) if claimable else 0,
                    stamp if claimable else -stamp)
            if shared >= 1 and (best is None or rank > best):
                best, source = rank, cand
        if best is None:
            return _Match(tuple(hits), 0, None, False)
        return _Match(tuple(hits), best[0], source, best[1])

    def _unused_leaf(self, key: FullKey | PartialKey) -> bool:
        if len(key) == 3:
            return True  # partial leaves are never held and nothing can follow them
        if self._tiers is not None and key in self._tiers.host:
            return False  # a sequence's blocks are device blocks: a host block is copied
        return self._users[key] == 0 and not self._children.get(key)

    def _admit(self, seq_id: Hashable, prompt: Tokens, scope: Hashable, priority: int
               ) -> RequestReuse:
        if seq_id in self._seqs:
            raise ValueError(f"admit event for seq_id {seq_id!r}, which is already live")
        match = self._match(prompt, scope)
        if self._claims_under_pressure(match, prompt):
            # protecting the copy source would take the last block the admission needs:
            # the cache claims it instead, evicting what follows it (docs/design.md)
            assert self._tiers is not None and match.source is not None
            self._tiers.evict_below(match.source)
            match = _Match(match.full_keys, match.partial_tokens, match.source, True)
        if match.source is not None and match.claim:
            self._uncache(match.source)
            if self._tiers is not None:
                self._tiers.claimed(match.source)
        reused = len(match.full_keys) * self.cfg.tokens_per_block + match.partial_tokens
        seq = _Seq(scope, list(prompt), reused, list(match.full_keys), priority)
        seq.first = self._first_held(seq)
        for key in seq.keys[seq.first:]:
            self._hold(key, seq)
        self._seqs[seq_id] = seq
        action: Literal["claim", "copy"] | None = None
        if match.partial_tokens:
            action = "claim" if match.claim else "copy"
        moves = None
        tiers = self._tiers
        if tiers is not None:
            new = self._blocks(seq) - len(match.full_keys) - (action == "claim")
            copy = match.source if action == "copy" else None
            before = (tiers.offloaded, tiers.dropped)
            onboarded = tiers.admit(match.full_keys, new, priority, copy)
            onboarded += copy is not None and tiers.copy_from_host(copy, priority)
            moves = (onboarded, tiers.offloaded - before[0], tiers.dropped - before[1])
        result = RequestReuse.for_prompt(
            seq_id, len(prompt), self.cfg.tokens_per_block, len(match.full_keys),
            match.partial_tokens, action, moves)
        self._admissions.append(result)
        return result

    def _claims_under_pressure(self, match: _Match, prompt: Tokens) -> bool:
        """Whether an admission that would copy its partial hit from an unheld full block
        claims it instead: its new blocks (the copy's among them) are exactly all the
        pool can supply (free, plus every unheld block but its own hits)."""
        tiers, source = self._tiers, match.source
        if tiers is None or source is None or match.claim or len(source) != 2 \
                or self._users[source] or source not in tiers.device:
            return False
        need = -(-len(prompt) // self.cfg.tokens_per_block) - len(match.full_keys)
        return need == tiers.available(match.full_keys)

    def _commit(self, seq_id: Hashable, seq: _Seq, n: int) -> None:
        if n < seq.committed or n > len(seq.tokens):
            raise ValueError(f"commit of {n} tokens for seq_id {seq_id!r}: must lie in "
                             f"[{seq.committed}, {len(seq.tokens)}] (committed so far, "
                             "token count)")
        seq.committed = n
        if not self.cfg.enable_block_reuse:
            return
        B = self.cfg.tokens_per_block
        tiers = self._tiers
        for i in range(len(seq.keys), n // B):
            key = (seq.scope, tuple(seq.tokens[: (i + 1) * B]))
            if key not in self._cached:
                self._cache(key)
                if tiers is not None:
                    tiers.cached(key, seq.priority)
            elif tiers is not None and key in tiers.host:
                tiers.cached(key, seq.priority)  # the host's copy gives way to this one's
            elif tiers is not None:  # deduplicated: it holds the cached one, frees its own
                tiers.freed(1)
            self._hold(key, seq)
            seq.keys.append(key)
        first = self._first_held(seq)
        self._unuse(seq.keys[seq.first:first])
        seq.first = max(first, seq.first)

    def _first_held(self, seq: _Seq) -> int:
        """The first block `seq` holds before computing from `seq.committed`."""
        window = self.cfg.sliding_window
        if window is None:
            return 0
        first = max(0, seq.committed - window + 1) // self.cfg.tokens_per_block
        return min(first, max(len(seq.keys) - 1, 0))

    def _hold(self, key: FullKey, seq: _Seq) -> None:
        """`seq` holds cached block `key` from now (the pools see its priority first)."""
        if self._tiers is not None:
            self._tiers.hold(key, seq.priority)
        self._users[key] += 1

    def _unuse(self, keys: Sequence[FullKey]) -> None:
        for key in keys:
            self._users[key] -= 1
            if self._users[key] == 0:
                del self._users[key]
                if self._tiers is not None:
                    self._tiers.released(key)

    def _free(self, seq_id: Hashable, seq: _Seq) -> None:
        del self._seqs[seq_id]
        tiers = self._tiers
        if tiers is not None:
            tiers.tick()
        self._unuse(seq.keys[seq.first:])
        tail = self._cache_tail(seq)
        if tiers is not None:
            private = self._blocks(seq) - len(seq.keys)
            if tail is not None:  # its block joins the cache
                tiers.cached(tail, seq.priority)
                private -= 1
            tiers.freed(private)

    def _cache_tail(self, seq: _Seq) -> PartialKey | None:
        """Cache the committed partial tail of a freed sequence; returns its key when it
        was cached."""
        B = self.cfg.tokens_per_block
        partial = self.cfg.enable_block_reuse and self.cfg.enable_partial_reuse
        if not partial or seq.committed % B == 0:
            return None  # without partial reuse a tail could never be matched: not cached
        start = seq.committed // B * B
        parent = (seq.scope, tuple(seq.tokens[:start]))
        tail = tuple(seq.tokens[start : seq.committed])
        for cand in self._children.get(parent, ()):
            block = cand[1][start:] if len(cand) == 2 else cand[2]
            if block[: len(tail)] == tail:
                return None  # an existing block already starts with this tail
        key = (parent[0], parent[1], tail)
        self._cache(key)
        return key

    def _blocks(self, seq: _Seq) -> int:
        return -(-len(seq.tokens) // self.cfg.tokens_per_block)

    def _cache(self, key: FullKey | PartialKey) -> None:
        self._clock += 1
        self._cached[key] = self._clock
        self._children[_parent(key, self.cfg.tokens_per_block)].add(key)

    def _uncache(self, key: FullKey | PartialKey) -> None:
        del self._cached[key]
        parent = _parent(key, self.cfg.tokens_per_block)
        self._children[parent].remove(key)
        if not self._children[parent]:
            del self._children[parent]


def _parent(key: FullKey | PartialKey, B: int) -> ParentKey:
    if len(key) == 2:
        return (key[0], key[1][:-B])
    return (key[0], key[1])


def _common_prefix(a: Tokens, b: Tokens) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def replay(events: Iterable[Event | Mapping[str, Any] | Any], cfg: OracleConfig
           ) -> OraclePrediction:
    """Predict reuse for a whole event log (e.g. `engine.admission_log()`)."""
    return ReuseOracle(cfg).replay(events)


def predict_sequential(prompts: Sequence[Sequence[int]],
                       outputs_or_generated_tokens: Sequence[Any] | None,
                       scopes: Sequence[Any] | None, cfg: OracleConfig) -> OraclePrediction:
    """Reuse when each request runs alone, after the previous one finished.

    Request i (seq_id i) is admitted, its generated tokens appended, then it commits its
    prompt plus every generated token but the last (the last sampled token's KV is never
    computed), then it is freed. `outputs_or_generated_tokens[i]` is a token list or an
    object with `token_ids` (an engine result); None means nothing was generated.
    Raises ValueError when the lengths of the three sequences differ.
    """
    outs = outputs_or_generated_tokens
    if outs is not None and len(outs) != len(prompts):
        raise ValueError(f"predict_sequential: {len(outs)} outputs for {len(prompts)} prompts")
    if scopes is not None and len(scopes) != len(prompts):
        raise ValueError(f"predict_sequential: {len(scopes)} scopes for {len(prompts)} prompts")
    oracle = ReuseOracle(cfg)
    for i, prompt in enumerate(prompts):
        out = None if outs is None else outs[i]
        generated = list(getattr(out, "token_ids", out) or ())
        scope = None if scopes is None else scopes[i]
        oracle.apply(Event("admit", i, tuple(prompt), 0, scope))
        oracle.apply(Event("append", i, tuple(generated)))
        oracle.apply(Event("commit", i, (), len(prompt) + max(len(generated) - 1, 0)))
        oracle.apply(Event("free", i))
    return oracle.prediction()
