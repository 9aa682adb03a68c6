"""Proves siblings admitted in one step are correct, deduplicated and reused as the oracle says.

Their committed prefix blocks are cached once and reuse follows the engine's admission
order; computing the shared prefix only once (in-batch sharing) is expected to fail
until it exists.
"""

from __future__ import annotations

import pytest

from harness.workloads import shared_system_prompt
from tests.scenarios.support import (
    ALL_BACKENDS,
    MODES,
    TORCH,
    VOCAB,
    BackendSpec,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    forced,
)

N, PREFIX, SUFFIX, NEW_TOKENS = 4, 32, 5, 3  # PREFIX is a whole number of blocks
BLOCKS = [pytest.param(B, id=f"B{B}") for B in (4, 16)]


def siblings(seed: int) -> list[list[int]]:
    """N prompts: one PREFIX-token prefix, SUFFIX distinct tokens each."""
    return shared_system_prompt(N, PREFIX, SUFFIX, vocab=VOCAB, seed=seed)


def distinct_blocks(B: int, tokens_each: int) -> int:
    """Blocks the tree holds once siblings committed `tokens_each` tokens: the prefix's
    once, every block past it (full or a partial tail) once per sibling."""
    return PREFIX // B + N * (-(-tokens_each // B) - PREFIX // B)


@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_siblings_in_one_step_are_correct_and_deduplicated(
        make_engine: EngineFactory, scenario: ScenarioRun, backend: BackendSpec,
        mode: ReuseMode, B: int) -> None:
    prompts = siblings(B)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend)
    engine = make_engine(B, backend=backend, mode=mode)
    force = forced(reference, backend)
    rids = [engine.add_request(p, NEW_TOKENS, force_tokens=force[i] if force else None)
            for i, p in enumerate(prompts)]
    done = {o.request_id: o for o in engine.step()}
    assert [engine.manager.get_sequence(r).num_cached_tokens for r in rids] == [0] * N
    # every sibling committed the prefix in the same step: its blocks are cached once
    full_only = (PREFIX + SUFFIX) // B * B
    assert engine.kv_cache_stats().cached_num_blocks == distinct_blocks(B, full_only)
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    cold = [done[r] for r in rids]
    assert_same_outputs(reference, cold, backend, "siblings vs no reuse")
    assert engine.kv_cache_stats().cached_num_blocks == distinct_blocks(
        B, PREFIX + SUFFIX + NEW_TOKENS - 1)
    warm = engine.generate(prompts, NEW_TOKENS, force_tokens=force)
    assert_same_outputs(reference, warm, backend, "warm siblings vs no reuse")
    scenario.expect_oracle(engine, cold + warm, seed=B)


@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("mode", MODES)
def test_siblings_admitted_after_the_first_reuse_its_prefix(
        make_engine: EngineFactory, scenario: ScenarioRun, mode: ReuseMode, B: int) -> None:
    prompts = siblings(B + 1)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS)
    # unchunked, a budget of one prompt: the first runs alone, the rest join its decode
    engine = make_engine(B, mode=mode, max_num_tokens=PREFIX + SUFFIX + 3,
                         enable_chunked_prefill=False)
    outs = engine.generate(prompts, NEW_TOKENS)
    assert_same_outputs(reference, outs, TORCH, "staggered siblings vs no reuse")
    assert [o.num_cached_tokens for o in outs] == [0] + [PREFIX] * (N - 1)
    scenario.expect_oracle(engine, outs, seed=B + 1)


@pytest.mark.xfail(strict=True, reason="in-batch prefix sharing is not implemented: siblings "
                   "admitted in one step each compute the shared prefix")
def test_in_batch_sharing_computes_the_prefix_once(make_engine: EngineFactory) -> None:
    B = 16
    engine = make_engine(B)
    engine.generate(siblings(0), 1)  # one new token: only prompt tokens are computed
    # about one prefix plus N suffixes: a block of slack, far below N whole prompts
    assert engine.num_computed_tokens <= PREFIX + N * SUFFIX + B
