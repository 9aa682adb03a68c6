"""Preemption under memory pressure: evicted mid-decode, resumed by recompute.

When a decoding request gets no block for its next token the engine releases it (its
committed blocks stay cached, evictable) and queues it first; re-admitted, it reuses
whatever of its chain survived and recomputes the rest. Its outputs must equal an
undisturbed run's, token for token and logit for logit.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from kvcache import Engine, KvCacheConfig, KvCacheManager, ReuseScope
from kvcache.engine import GenerationOutput
from kvcache.model import Transformer, get_preset
from tests.reliability.support import (
    EngineSpec,
    assert_clean,
    assert_same_output,
    assert_same_outputs,
    cold_outputs,
)

STEM = list(range(30, 60))


def disjoint(n: int, length: int) -> list[list[int]]:
    return [STEM[i * length:(i + 1) * length] for i in range(n)]


class Readmission(NamedTuple):
    """A preempted request admitted again: what it had committed, what it reused."""

    rid: int
    committed: int  # tokens whose KV it had computed when it was preempted
    probed: int     # probe_reuse just before the step that admitted it again
    reused: int     # num_cached_tokens of that admission


def run_watching_readmissions(engine: Engine
                              ) -> tuple[list[Readmission], dict[int, GenerationOutput]]:
    """Step to the end; returns every re-admission of a preempted request, and outputs."""
    pending: dict[int, tuple[int, int]] = {}
    seen: list[Readmission] = []
    outs: dict[int, GenerationOutput] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            return seen, outs
        for r in engine.scheduler.waiting:
            if r.num_preemptions:
                # the preempted request is queued first, so this is exactly what its
                # admission in the next step will find
                pending[r.request_id] = (len(r.tokens) - 1, engine.manager.probe_reuse(r.tokens))
        outs.update((o.request_id, o) for o in engine.step())
        for r in engine.scheduler.running:
            if r.request_id in pending and r.seq is not None:
                committed, probed = pending.pop(r.request_id)
                seen.append(Readmission(r.request_id, committed, probed, r.seq.num_cached_tokens))
    raise AssertionError("the engine did not finish in 200 steps")


def test_preempted_request_reuses_what_survived(tiny_model: Transformer) -> None:
    prompts = disjoint(3, 6)
    undisturbed = cold_outputs(tiny_model, prompts, 6)
    engine = EngineSpec(2, 9, partial=False).build(tiny_model)  # 18 blocks wanted at the end
    rids = [engine.add_request(p, 6) for p in prompts]
    seen, outs = run_watching_readmissions(engine)
    assert seen, "the pool was meant to force preemption"
    for r in seen:
        assert r.reused == r.probed, f"{r}: the re-admission reused what probe_reuse said"
        assert r.reused % 2 == 0 and r.reused <= r.committed, r
    assert any(0 < r.reused < r.committed for r in seen), (
        f"expected a re-admission that reused a surviving part of its chain: {seen}")
    assert engine.kv_cache_stats().evicted_blocks > 0
    assert_same_outputs(undisturbed, [outs[r] for r in rids], "pressured")
    assert_clean(engine.manager, "after the pressured run")


@pytest.mark.parametrize(("spec", "n", "length", "new"), [
    pytest.param(EngineSpec(2, 9), 3, 6, 6, id="b2-p9-partial"),
    pytest.param(EngineSpec(2, 9, partial=False), 3, 6, 6, id="b2-p9-full-only"),
    pytest.param(EngineSpec(4, 6, max_num_tokens=5), 3, 7, 8, id="b4-p6-chunked"),
    pytest.param(EngineSpec(1, 14, max_batch_size=3), 4, 3, 5, id="b1-p14"),
    pytest.param(EngineSpec(2, 12, reuse=False), 4, 5, 6, id="b2-no-reuse"),
])
def test_pressured_run_equals_undisturbed(tiny_model: Transformer, spec: EngineSpec, n: int,
                                          length: int, new: int) -> None:
    prompts = disjoint(n, length)
    prompts[-1] = [*prompts[0][:length - 1], 7]  # a shared prefix as well
    undisturbed = cold_outputs(tiny_model, prompts, new)
    engine = spec.build(tiny_model)
    outs = engine.generate(prompts, max_new_tokens=new)
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert_same_outputs(undisturbed, outs, f"{spec}")
    assert_clean(engine.manager, f"{spec}")
    again = engine.generate(prompts, max_new_tokens=new)  # warm, under the same pressure
    assert_same_outputs(undisturbed, again, f"{spec}, second round")
    assert_clean(engine.manager, f"{spec}, second round")


def test_preemption_keeps_scopes_apart(tiny_model: Transformer) -> None:
    base = disjoint(1, 6)[0]
    prompts = [base, base, [*base[:5], 9]]
    scopes = [None, ReuseScope(salt=1), ReuseScope(salt=1)]
    undisturbed = cold_outputs(tiny_model, prompts, 6)
    engine = EngineSpec(2, 9).build(tiny_model)
    rids = [engine.add_request(p, 6, s) for p, s in zip(prompts, scopes, strict=True)]
    scope_of = dict(zip(rids, scopes, strict=True))
    outs: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
        live = engine.manager.sequences
        for a in live:
            for b in live:
                if scope_of[a] != scope_of[b]:
                    shared = set(live[a].block_ids) & set(live[b].block_ids)
                    assert not shared, f"requests {a} and {b} of different scopes share {shared}"
    assert sum(o.num_preemptions for o in outs.values()) > 0
    for i, rid in enumerate(rids):
        assert_same_output(undisturbed[i], outs[rid], f"request {rid}")
    assert_clean(engine.manager, "after the scoped run")


def test_hybrid_model_recomputes_recurrent_state_after_preemption() -> None:
    model = Transformer(get_preset("hybrid-tiny"), seed=0)
    prompts = disjoint(3, 6)
    roomy = Engine(model, KvCacheConfig(tokens_per_block=2, max_num_blocks=64))
    tight = Engine(model, KvCacheConfig(tokens_per_block=2, max_num_blocks=9))
    undisturbed = roomy.generate(prompts, max_new_tokens=6)
    outs = tight.generate(prompts, max_new_tokens=6)
    assert sum(o.num_preemptions for o in outs) > 0
    assert_same_outputs(undisturbed, outs, "hybrid under pressure")
    assert_clean(tight.manager, "hybrid under pressure")


# -- an admission the pool can hold must not be refused ---------------------------------
# A partial hit needing a copy holds its source while it allocates; when that takes the
# block the admission needs, the admission takes every available block either way, so
# the manager claims the source (evicting what follows it) instead of copying it.


def test_manager_admits_a_prompt_that_fits_claiming_its_copy_source() -> None:
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=2))
    mgr.add_sequence("a", [1, 2, 3, 4, 5, 6, 7])
    mgr.commit("a", 7)
    mgr.free_sequence("a")  # cached: [1 2 3 4] -> [5 6 7]; [1 2 3 4] is interior
    # 2 blocks wanted, the pool has 2 free or evictable; a copy of [1 2 3] would need 3
    seq = mgr.add_sequence("b", [1, 2, 3, 9, 9, 9, 9])
    assert (seq.num_cached_tokens, mgr.pending_copy_ops) == (3, [])
    assert (mgr.stats().claimed_blocks, mgr.stats().evicted_blocks) == (1, 1)
    mgr.free_sequence("b")
    assert_clean(mgr, "after b")


def test_engine_runs_a_prompt_that_fits_claiming_its_copy_source(
        tiny_model: Transformer) -> None:
    engine = EngineSpec(4, 2).build(tiny_model)
    engine.generate([[1, 2, 3, 4, 5, 6, 7]], max_new_tokens=1)
    out = engine.generate([[1, 2, 3, 9, 9, 9, 9]], max_new_tokens=1)
    assert_same_outputs(cold_outputs(tiny_model, [[1, 2, 3, 9, 9, 9, 9]], 1), out, "b")
    assert_clean(engine.manager, "after b")
