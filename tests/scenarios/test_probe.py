"""Proves probe_reuse equals the next admission's reuse and changes nothing (stats, tree, LRU).

On prompt trees branching anywhere in a block, under every reuse setting and scope.
"""

from __future__ import annotations

import random

import pytest

from harness.workloads import random_prompt_tree
from kvcache import Engine, GenerationOutput, ReuseScope
from tests.scenarios.support import (
    MODES,
    NO_PARTIAL,
    TORCH,
    VOCAB,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    tokens,
)

NEW_TOKENS = 2


def probe_then_run(engine: Engine, prompt: list[int], scope: ReuseScope | None = None,
                   new_tokens: int = NEW_TOKENS) -> GenerationOutput:
    """Probe, then run `prompt` alone; the admission must reuse exactly what was probed."""
    probed = engine.manager.probe_reuse(prompt, scope)
    out = engine.generate([prompt], new_tokens, [scope])[0]
    assert out.num_cached_tokens == probed, (
        f"probe_reuse said {probed} tokens for a prompt of {len(prompt)}, the admission "
        f"reused {out.num_cached_tokens}\n{engine.manager.state.tree.dump()}")
    return out


@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (1, 2, 4, 16)])
@pytest.mark.parametrize("mode", MODES)
def test_probe_equals_the_next_admission(make_engine: EngineFactory, scenario: ScenarioRun,
                                         mode: ReuseMode, B: int) -> None:
    prompts = random_prompt_tree(seed=B, depth=3, branching=3, segment_len=B + 5, vocab=VOCAB)
    scopes = [None, ReuseScope(salt=1)]
    engine = make_engine(B, mode=mode)
    outs = [probe_then_run(engine, p, scopes[i % 2]) for i, p in enumerate(prompts)]
    # again, backwards and in the other scope: full hits, claims, copies and misses mix
    outs += [probe_then_run(engine, p, scopes[i % 2 - 1]) for i, p in enumerate(prompts[::-1])]
    assert sum(o.num_cached_tokens for o in outs) > 0
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS)
    by_prompt = {tuple(o.prompt): o for o in reference}
    assert_same_outputs([by_prompt[o.prompt] for o in outs], outs, TORCH, "probed vs reference")
    scenario.expect_oracle(engine, outs, seed=B)


@pytest.mark.parametrize("mode", MODES)
def test_probing_changes_nothing(make_engine: EngineFactory, mode: ReuseMode) -> None:
    B = 4
    rng = random.Random(2)
    engine = make_engine(B, mode=mode)
    base = tokens(rng, 23)
    engine.generate([base, base[:9] + tokens(rng, 8)], NEW_TOKENS)
    stats, tree = engine.kv_cache_stats(), engine.manager.state.tree.dump()
    probes = [base, base[:9], [*base[:10], 1], [*base, 2], tokens(rng, 30), [base[0]]]
    for scope in (None, ReuseScope(salt=1)):
        for p in probes:
            engine.manager.probe_reuse(p, scope)
    assert engine.kv_cache_stats() == stats
    assert engine.manager.state.tree.dump() == tree
    engine.manager.check_integrity()


def test_probing_does_not_refresh_lru(make_engine: EngineFactory, scenario: ScenarioRun) -> None:
    """X, Y, Z fill 9 of 10 blocks; Y, the oldest, is probed again and again; W still
    evicts from Y, as if it had never been probed."""
    B = 4
    x, y, z, w = (tokens(random.Random(s), 3 * B) for s in range(4))
    engine = make_engine(B, mode=NO_PARTIAL, max_num_blocks=10)
    outs = [probe_then_run(engine, p, new_tokens=1) for p in (y, x, z)]
    for _ in range(3):
        assert engine.manager.probe_reuse(y) == 2 * B
    outs.append(probe_then_run(engine, w, new_tokens=1))
    assert engine.kv_cache_stats().evicted_blocks == 2
    assert [engine.manager.probe_reuse(p) for p in (x, y, z)] == [2 * B, B, 2 * B]
    scenario.expect_oracle(engine, outs, exact=False)
