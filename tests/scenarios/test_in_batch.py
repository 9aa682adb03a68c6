"""Proves siblings that arrive together compute their shared prefix once, and stay correct.

With in-batch prefix sharing (the default) the first sibling leads: the others wait
until it has committed the prefix and are then admitted with reuse. Without it
(`share_prefixes=False`) siblings admitted in one step each compute the prefix and its
blocks are deduplicated at commit. Either way outputs equal a run with no reuse and the
oracle predicts the reuse from the admission log.
"""

from __future__ import annotations

import pytest

from harness.workloads import shared_system_prompt
from kvcache.engine.prefix_sharing import leader_of
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


def distinct_blocks(B: int, tokens_each: int, tails: bool = True) -> int:
    """Blocks the tree holds once siblings committed `tokens_each` tokens: the prefix's
    once, every block past it once per sibling, a partial tail only with `tails` (partial
    reuse on)."""
    per_sibling = -(-tokens_each // B) if tails else tokens_each // B
    return PREFIX // B + N * (per_sibling - PREFIX // B)


@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_siblings_in_one_step_are_correct_and_deduplicated(
        make_engine: EngineFactory, scenario: ScenarioRun, backend: BackendSpec,
        mode: ReuseMode, B: int) -> None:
    prompts = siblings(B)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend)
    engine = make_engine(B, backend=backend, mode=mode, share_prefixes=False)
    force = forced(reference, backend)
    rids = [engine.add_request(p, NEW_TOKENS, force_tokens=force[i] if force else None)
            for i, p in enumerate(prompts)]
    done = {o.request_id: o for o in engine.step()}
    assert [engine.manager.sequences[r].num_cached_tokens for r in rids] == [0] * N
    # every sibling committed the prefix in the same step: its blocks are cached once
    full_only = (PREFIX + SUFFIX) // B * B
    assert engine.kv_cache_stats().cached_num_blocks == distinct_blocks(B, full_only)
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    cold = [done[r] for r in rids]
    assert_same_outputs(reference, cold, backend, "siblings vs no reuse")
    assert engine.kv_cache_stats().cached_num_blocks == distinct_blocks(
        B, PREFIX + SUFFIX + NEW_TOKENS - 1, tails=mode.partial)
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


@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_siblings_in_one_call_share_the_prefix(
        make_engine: EngineFactory, scenario: ScenarioRun, backend: BackendSpec,
        mode: ReuseMode, B: int) -> None:
    prompts = siblings(B + 2)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend)
    engine = make_engine(B, backend=backend, mode=mode)
    force = forced(reference, backend)
    outs = engine.generate(prompts, NEW_TOKENS, force_tokens=force)
    assert_same_outputs(reference, outs, backend, "shared siblings vs no reuse")
    # the leader computes the prefix; every sibling reuses its full blocks
    assert [o.num_cached_tokens for o in outs] == [0] + [PREFIX] * (N - 1)
    scenario.expect_oracle(engine, outs, seed=B + 2)


def test_in_batch_sharing_computes_the_prefix_once(make_engine: EngineFactory) -> None:
    B = 16
    engine = make_engine(B)
    engine.generate(siblings(0), 1)  # one new token: only prompt tokens are computed
    # about one prefix plus N suffixes: a block of slack, far below N whole prompts
    assert engine.num_computed_tokens <= PREFIX + N * SUFFIX + B
    off = make_engine(B, share_prefixes=False)
    off.generate(siblings(0), 1)
    assert off.num_computed_tokens == N * (PREFIX + SUFFIX)


@pytest.mark.parametrize("chunk", [8, 12, 40])
def test_a_sibling_waits_at_most_the_leaders_prefill(make_engine: EngineFactory,
                                                     chunk: int) -> None:
    B = 4
    engine = make_engine(B, max_num_tokens=chunk)
    prompts = siblings(chunk)
    rids = [engine.add_request(p, NEW_TOKENS) for p in prompts]
    held_after: list[int] = []  # steps after which some sibling was still being held
    outs = {}
    step = 0
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step()}
        step += 1
        sched = engine.scheduler
        for req in sched.waiting:
            plan = engine.manager.plan_admission(req.tokens, req.scope)
            if leader_of(req, plan.num_full_blocks, sched.running, B) is not None:
                held_after.append(step)
    # the leader computes the PREFIX shared tokens in chunks of `chunk` tokens; once it
    # has, nobody is held (admission then only waits for budget, as any request does)
    assert max(held_after, default=0) < -(-PREFIX // chunk)
    assert [outs[r].num_cached_tokens for r in rids] == [0] + [PREFIX] * (N - 1)


def test_unrelated_requests_are_not_held_behind_a_waiting_sibling(
        make_engine: EngineFactory) -> None:
    B = 4
    engine = make_engine(B, max_num_tokens=64)
    leader, sibling, *_ = siblings(9)
    other = [7] * 9  # shares nothing with them
    rl, rs, ro = (engine.add_request(p, NEW_TOKENS) for p in (leader, sibling, other))
    engine.step()
    live = engine.manager.sequences
    assert rl in live and ro in live and rs not in live  # held, but not blocking `other`
    outs = {o.request_id: o for o in engine.step()}
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step()}
    assert outs[rs].num_cached_tokens == PREFIX and outs[ro].num_cached_tokens == 0
