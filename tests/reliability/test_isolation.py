"""Reuse scopes are isolated: no tenant can reuse, probe or sense another's blocks.

Random interleavings of admissions, commits, appends, frees and probes from several
scopes run on one KvCacheManager. Each scope has its own oracle, fed only that scope's
events; every admission's metrics and every probe must equal what that oracle predicts,
so nothing another scope did can show in them. Live sequences of different scopes never
share a block, and a reused block or copy source was last held by the same scope. The
provenance oracle (`CheckedManager`) checks every reused slot holds KV of the reader's
own scope, and the capacity oracle every block count.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.oracle import OracleConfig, ReuseOracle
from harness.oracle.checked_manager import CheckedManager
from kvcache import KvCacheConfig, KvCacheManager, OutOfBlocksError, ReuseScope
from kvcache.engine import GenerationOutput
from kvcache.model import Transformer
from tests.reliability.support import EngineSpec, assert_clean

# ReuseScope() is the default scope, the same as None; salt 0 is a scope of its own.
SCOPES: list[ReuseScope | None] = [None, ReuseScope(), ReuseScope(salt=0), ReuseScope(salt=1),
                                   ReuseScope(lora_id=1), ReuseScope(salt=1, lora_id=1)]
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 9, 9, 9], [4, 4, 4, 4, 4]]

# Every scope draws from the same prompts, so identical prefixes across scopes are common.
prompts = st.builds(lambda stem, cut, tail: stem[:cut] + tail, st.sampled_from(STEMS),
                    st.integers(0, 10), st.lists(st.integers(1, 3), max_size=4)).filter(bool)
ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(0, len(SCOPES) - 1), prompts),
    st.tuples(st.just("probe"), st.integers(0, len(SCOPES) - 1), prompts),
    st.tuples(st.just("commit"), st.integers(0, 99), st.floats(0, 1)),
    st.tuples(st.just("append"), st.integers(0, 99), st.lists(st.integers(1, 3), min_size=1,
                                                                max_size=3)),
    st.tuples(st.just("free"), st.integers(0, 99), st.none()),
), min_size=1, max_size=40)


def key(scope: ReuseScope | None) -> Hashable:
    return None if scope is None else scope.key


@dataclass
class World:
    """One manager, one oracle per scope, and who last held each block."""

    mgr: CheckedManager
    cfg: OracleConfig
    exact: bool  # pool large enough that nothing is evicted
    oracles: dict[Hashable, ReuseOracle] = field(default_factory=dict)
    scope_of: dict[Hashable, Hashable] = field(default_factory=dict)
    holder: dict[int, Hashable] = field(default_factory=dict)  # block id -> scope key
    seen: int = 0
    next_id: int = 0

    def oracle(self, k: Hashable) -> ReuseOracle:
        return self.oracles.setdefault(k, ReuseOracle(self.cfg))

    def feed(self) -> list[Any]:
        """Route the manager's new events to the oracle of their sequence's scope."""
        assert self.mgr.state.events is not None
        out = [self.oracle(self.scope_of[e.seq_id]).apply(e.as_dict())
               for e in self.mgr.state.events[self.seen:]]
        self.seen = len(self.mgr.state.events)
        return out

    def hold(self, seq_id: Hashable) -> None:
        for b in self.mgr.sequences[seq_id].block_ids:
            self.holder[b] = self.scope_of[seq_id]

    def check_disjoint(self) -> None:
        owner: dict[int, Hashable] = {}
        for sid, seq in self.mgr.sequences.items():
            for b in seq.block_ids:
                other = owner.setdefault(b, self.scope_of[sid])
                assert other == self.scope_of[sid], (
                    f"block {b} is held by scopes {other!r} and {self.scope_of[sid]!r}")


def admit(w: World, scope: ReuseScope | None, prompt: list[int]) -> None:
    sid, k = w.next_id, key(scope)
    w.next_id += 1
    before = w.mgr.stats()
    w.scope_of[sid] = k
    try:
        seq = w.mgr.add_sequence(sid, prompt, scope)
    except OutOfBlocksError:
        assert not w.exact
        return
    (predicted,) = [p for p in w.feed() if p is not None]
    m = seq.metrics
    got = (m.num_full_reused_blocks, m.num_partial_reused_blocks, m.num_missed_blocks,
           m.num_reused_tokens)
    want = (predicted.full_reused_blocks, predicted.partial_reused_blocks,
            predicted.missed_blocks, predicted.reused_tokens)
    if w.exact:
        assert got == want, f"scope {k!r} admission {prompt}: got {got}, scope oracle {want}"
        delta = w.mgr.stats().minus(before)
        assert (delta.copied_blocks, delta.claimed_blocks) == (
            predicted.partial_action == "copy", predicted.partial_action == "claim")
    else:  # eviction only removes blocks; with partial reuse off this is an upper bound
        assert got[0] <= want[0] and got[3] <= want[3], f"scope {k!r}: {got} > {want}"
    reused = seq.block_ids[:m.num_full_reused_blocks]
    foreign = [b for b in reused if w.holder.get(b) != k]
    assert not foreign, f"scope {k!r} reused blocks {foreign} last held by another scope"
    for op in w.mgr.take_copy_ops():
        assert w.holder.get(op.src) == k, f"scope {k!r} copied from block {op.src}"
    w.hold(sid)


def step(w: World, op: tuple[str, int, Any]) -> None:
    kind, arg, extra = op
    if kind == "admit":
        admit(w, SCOPES[arg], extra)
        return
    if kind == "probe":
        scope = SCOPES[arg]
        got = w.mgr.probe_reuse(extra, scope)
        want = w.oracle(key(scope)).probe(extra, scope)
        assert got == want if w.exact else got <= want, (
            f"probe of {extra} in scope {key(scope)!r}: {got}, scope oracle {want}")
        return
    live = list(w.mgr.sequences)  # admission order
    if not live:
        return
    sid = live[arg % len(live)]
    seq = w.mgr.sequences[sid]
    if kind == "commit":
        lo = seq.num_committed_tokens
        w.mgr.commit(sid, lo + round(extra * (seq.num_tokens - lo)))
    elif kind == "append":
        try:
            w.mgr.append_tokens(sid, extra)
        except OutOfBlocksError:
            assert not w.exact
            return
        w.hold(sid)
    else:
        w.mgr.free_sequence(sid)
    w.feed()


def run_world(block: int, pool: int, partial: bool, copy: bool,
              script: list[tuple[str, int, Any]]) -> None:
    cfg = KvCacheConfig(tokens_per_block=block, max_num_blocks=pool, enable_block_reuse=True,
                        enable_partial_reuse=partial, copy_on_partial_reuse=copy)
    w = World(CheckedManager(KvCacheManager(cfg, record_events=True)),
              OracleConfig.from_cache_config(cfg), exact=pool >= 10_000)
    for op in script:
        step(w, op)
        w.check_disjoint()
    w.mgr.check_integrity()
    for sid in list(w.mgr.sequences):
        w.mgr.free_sequence(sid)
    assert_clean(w.mgr, "after the interleaving")


@settings(max_examples=80, deadline=None)
@given(block=st.sampled_from([1, 2, 3, 4]),
       policy=st.sampled_from([(True, True), (True, False), (False, False)]), script=ops)
def test_scopes_never_see_each_other(block: int, policy: tuple[bool, bool],
                                     script: list[tuple[str, int, Any]]) -> None:
    run_world(block, 10_000, *policy, script)


@settings(max_examples=60, deadline=None)
@given(block=st.sampled_from([2, 3, 4]), pool=st.integers(5, 16), script=ops)
def test_scopes_stay_apart_under_eviction(block: int, pool: int,
                                          script: list[tuple[str, int, Any]]) -> None:
    run_world(block, pool, False, False, script)


def test_engine_requests_reuse_only_their_own_scope(tiny_model: Transformer) -> None:
    """Interleaved waves on one engine: each request's reuse is its own scope's alone."""
    engine = EngineSpec(4, 64).build(tiny_model)
    base = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    waves: list[list[tuple[list[int], ReuseScope | None]]] = [[(base, None), (base, ReuseScope(salt=1))],
             [(base, ReuseScope(salt=2)), ([*base[:6], 1, 2], ReuseScope(salt=1)),
              ([*base, 3], ReuseScope())],
             [(base, ReuseScope(salt=2)), (base, ReuseScope(lora_id=5))]]
    outs: list[GenerationOutput] = []
    for wave in waves:
        outs += engine.generate([p for p, _ in wave], 3, [s for _, s in wave])
    scopes = [s for wave in waves for _, s in wave]
    by_scope: dict[Hashable, ReuseOracle] = {}
    rid_scope = {o.request_id: key(s) for o, s in zip(outs, scopes, strict=True)}
    predicted: dict[int, int] = {}
    for event in engine.admission_log():
        k = rid_scope[event["seq_id"]]
        result = by_scope.setdefault(k, ReuseOracle(OracleConfig.from_cache_config(engine.cache_config))).apply(event)
        if result is not None:
            predicted[event["seq_id"]] = result.reused_tokens
    assert [o.num_cached_tokens for o in outs] == [predicted[o.request_id] for o in outs]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 6, 9, 8, 0]
    assert_clean(engine.manager, "after the scoped waves")
