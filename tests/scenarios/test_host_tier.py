"""Proves the host tier keeps outputs right: blocks offloaded and onboarded again give the
tokens and logits of a run without reuse, whatever the block size, chunking, partial
reuse, scope or preemption, and two requests whose blocks cross the tiers in interleaved
order never see each other's tokens (TensorRT-LLM issue 8813: its transfers raced).

Each engine has a device pool smaller than the working set and a host tier at least
twice its size, so full blocks survive eviction on the host. With partial reuse off the
bounded oracle predicts every count exactly, offloads, onboards and drops included.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from harness.workloads import shared_system_prompt
from kvcache import Engine, GenerationOutput, ReuseScope
from kvcache.core.ops import BlockOffload, BlockOnboard, KvOp
from tests.scenarios.support import (
    ALL_BACKENDS,
    COPY,
    MODES,
    NO_PARTIAL,
    TORCH,
    VOCAB,
    BackendSpec,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    forced,
    tokens,
    unlike,
)

NEW_TOKENS = 4
# (tokens per block, device blocks, system prompt tokens): each pool holds a fraction of
# the working set (9 prompts: 3 system prompts + 5 tokens each); the host tier is 4x it
POOLS = [pytest.param(B, n, system, id=f"B{B}-pool{n}")
         for B, n, system in ((2, 36, 18), (4, 16, 18), (16, 6, 40))]


def record_ops(engine: Engine) -> list[list[KvOp]]:
    """Every batch of ops the engine applies from now on (each step's, in order)."""
    batches: list[list[KvOp]] = []
    apply = engine.storage.apply_copies

    def recording(ops: Sequence[KvOp]) -> None:
        batches.append(list(ops))
        apply(ops)

    engine.storage.apply_copies = recording  # type: ignore[method-assign]
    return batches


def expect_reuse_across_tiers(scenario: ScenarioRun, engine: Engine,
                              outs: list[GenerationOutput], mode: ReuseMode | None,
                              seed: int | None = None) -> None:
    """Offloads and onboards happened; reuse equals the bounded oracle (partial reuse off)
    or stays within the unbounded oracle's full-block bound (on)."""
    stats = engine.kv_cache_stats()
    assert stats.offloaded_blocks > 0 and stats.onboarded_blocks > 0, stats
    if mode == NO_PARTIAL:
        scenario.expect_oracle(engine, outs, seed=seed, bounded=True)
    else:
        scenario.expect_full_blocks_bounded(engine, outs, seed=seed)


def three_rounds(engine: Engine, prompts: list[list[int]],
                 reference: list[GenerationOutput], backend: BackendSpec
                 ) -> list[GenerationOutput]:
    """Run `prompts` three times, each round rotated one further; every round's outputs
    must equal the reference without reuse. Returns them all."""
    outs: list[GenerationOutput] = []
    for shift in range(3):
        ref = reference[shift:] + reference[:shift]
        got = engine.generate(prompts[shift:] + prompts[:shift], NEW_TOKENS,
                              force_tokens=forced(ref, backend))
        assert_same_outputs(ref, got, backend, f"round {shift} vs no reuse")
        outs += got
    return outs


@pytest.mark.parametrize(("B", "blocks", "system"), POOLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_offload_onboard_cycles_keep_warm_equal_to_cold(
        make_engine: EngineFactory, scenario: ScenarioRun, backend: BackendSpec,
        mode: ReuseMode, B: int, blocks: int, system: int) -> None:
    prompts = shared_system_prompt(9, system, 5, num_groups=3, vocab=VOCAB, seed=B)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend)
    engine = make_engine(B, backend=backend, mode=mode, max_num_blocks=blocks,
                         host_cache_blocks=4 * blocks)
    outs = three_rounds(engine, prompts, reference, backend)
    assert engine.kv_cache_stats().evicted_blocks > 0
    expect_reuse_across_tiers(scenario, engine, outs, mode, seed=B)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mixed_window_model_through_the_host(make_engine: EngineFactory,
                                             scenario: ScenarioRun, backend: BackendSpec) -> None:
    """A model interleaving 32-token-window layers with full ones keeps every block for
    its full layers, so its blocks go to the host and come back like any model's: prompts
    past the window, three rounds, warm equals cold and the bounded oracle is exact."""
    B, blocks, preset = 4, 16, "tiny-mixed-swa"
    prompts = shared_system_prompt(6, 40, 5, num_groups=3, vocab=VOCAB, seed=11)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend,
                                           preset=preset)
    engine = make_engine(B, backend=backend, mode=NO_PARTIAL, preset=preset,
                         max_num_blocks=blocks, host_cache_blocks=4 * blocks)
    assert engine.cache_config.sliding_window is None
    outs = three_rounds(engine, prompts, reference, backend)
    assert max(o.num_cached_tokens for o in outs) > 32  # reuse reaches past the window
    expect_reuse_across_tiers(scenario, engine, outs, NO_PARTIAL, seed=11)


@pytest.mark.parametrize(("B", "budget"), [pytest.param(4, 3, id="B4-T3"),
                                           pytest.param(4, 7, id="B4-T7"),
                                           pytest.param(16, 7, id="B16-T7")])
def test_chunked_prefill_over_onboarded_blocks(make_engine: EngineFactory,
                                               scenario: ScenarioRun, B: int,
                                               budget: int) -> None:
    """Prompts sharing 3 blocks, chunked by a budget that cuts blocks; a pool of one
    request's blocks and one more, so every group's prefix goes to the host between its
    uses."""
    rng = random.Random(B + budget)
    stems = [tokens(rng, 3 * B) for _ in range(3)]
    prompts = [stems[i % 3] + tokens(rng, B // 2 + 1) for i in range(6)]
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS)
    per_request = -(-(4 * B + B // 2 + 1 + NEW_TOKENS) // B)
    engine = make_engine(B, mode=NO_PARTIAL, max_num_blocks=per_request + 1,
                         host_cache_blocks=8 * per_request, max_num_tokens=budget,
                         max_batch_size=2)
    outs = engine.generate(prompts, NEW_TOKENS) + engine.generate(prompts, NEW_TOKENS)
    assert_same_outputs(reference + reference, outs, TORCH, "chunked, through the host")
    assert any(o.kv_metrics is not None and o.kv_metrics.num_onboarded_blocks for o in outs)
    expect_reuse_across_tiers(scenario, engine, outs, NO_PARTIAL)


@pytest.mark.parametrize("mode", MODES)
def test_a_partial_block_is_never_offloaded_half_written(
        make_engine: EngineFactory, scenario: ScenarioRun, mode: ReuseMode) -> None:
    """Prompts end mid-block, so every request leaves a partial tail (cached with partial
    reuse on) and decodes into a partial block; the pool fits one request. Only full blocks reach the host (partial
    ones are dropped), and prompts that stop inside a host block reuse it by a copy (an
    onboard of fewer than B tokens) or, without copies, not at all (a sequence cannot
    claim a host block)."""
    B = 4
    rng = random.Random(3)
    stem = tokens(rng, 2 * B + 2)  # 2 full blocks + a 2-token tail
    other = tokens(rng, 2 * B + 2)
    cut = [*stem[:B + 2], unlike(stem[B + 2]), *tokens(rng, 3)]  # stops inside block 1
    prompts = [stem, other, stem, cut, [*stem, 7]]
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS)
    engine = make_engine(B, mode=mode, max_num_blocks=5, host_cache_blocks=16)
    batches = record_ops(engine)
    outs = [engine.generate([p], NEW_TOKENS)[0] for p in prompts]
    assert_same_outputs(reference, outs, TORCH, "one by one through the host")
    stats = engine.kv_cache_stats()
    if mode.partial:  # tails are cached (for partial hits) and evicted, never offloaded
        assert stats.evicted_blocks > stats.offloaded_blocks, "partial tails were evicted too"
    host = [node for _, node in engine.manager.state.tree.walk() if node.host]
    assert host and all(len(node.key) == len(node.blocks) * B * 4 for node in host)
    partial_onboards = [op for batch in batches for op in batch
                        if type(op) is BlockOnboard and op.num_tokens < B]
    assert bool(partial_onboards) == (mode == COPY), partial_onboards
    expect_reuse_across_tiers(scenario, engine, outs, mode)


def test_scopes_never_share_across_tiers(make_engine: EngineFactory,
                                         scenario: ScenarioRun) -> None:
    """One prompt in three scopes, a pool of one request: each scope's blocks go to the
    host and come back for that scope only."""
    B = 4
    prompt = tokens(random.Random(5), 3 * B + 1)
    scopes = [None, ReuseScope(salt="a"), ReuseScope(lora_id=2)]
    reference = make_engine.cold_reference(B, [prompt], NEW_TOKENS)[0]
    engine = make_engine(B, mode=NO_PARTIAL, max_num_blocks=6, host_cache_blocks=24)
    outs: list[GenerationOutput] = []
    for round_ in range(2):
        for scope in scopes:
            out = engine.generate([prompt], NEW_TOKENS, [scope])[0]
            assert_same_outputs([reference], [out], TORCH, f"scope {scope}, round {round_}")
            assert out.num_cached_tokens == (3 * B if round_ else 0), (scope, round_)
            outs.append(out)
    expect_reuse_across_tiers(scenario, engine, outs, NO_PARTIAL)


@pytest.mark.parametrize("mode", MODES)
def test_preempted_requests_resume_over_onboarded_blocks(
        make_engine: EngineFactory, scenario: ScenarioRun, mode: ReuseMode) -> None:
    """A pool too small for three decoding requests preempts them; each resumes by
    recomputing, reusing its own prefix, which meanwhile went to the host."""
    B = 2
    prompts = [tokens(random.Random(i), 6) for i in range(3)]
    reference = make_engine.cold_reference(B, prompts, 6)
    engine = make_engine(B, mode=mode, max_num_blocks=9, host_cache_blocks=36)
    outs = engine.generate(prompts, 6) + engine.generate(prompts, 6)
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert_same_outputs(reference + reference, outs, TORCH, "preempted through the host")
    expect_reuse_across_tiers(scenario, engine, outs, mode)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_interleaved_offload_and_onboard_never_cross_talk(
        make_engine: EngineFactory, scenario: ScenarioRun, backend: BackendSpec) -> None:
    """Four prompts of one shape, a pool of two requests: each pair's admissions offload
    the other pair's blocks and onboard their own into the very device blocks just
    offloaded, and the second admission of a step offloads into the host slots the first
    just onboarded from. Applied in any other order than queued, a request would read the
    other's KV; every round must equal the run without reuse."""
    B = 4
    rng = random.Random(8813)
    x, y, z, w = (tokens(rng, 4 * B + 1) for _ in range(4))
    reference = make_engine.cold_reference(B, [x, y, z, w], NEW_TOKENS, backend=backend)
    ref = dict(zip("xyzw", reference, strict=True))
    engine = make_engine(B, backend=backend, mode=NO_PARTIAL, max_num_blocks=12,
                         host_cache_blocks=48, max_batch_size=2)
    batches = record_ops(engine)
    outs: list[GenerationOutput] = []
    for names in ("xy", "zw", "xy", "zw", "yx", "wz"):
        prompts = [dict(x=x, y=y, z=z, w=w)[n] for n in names]
        want = [ref[n] for n in names]
        got = engine.generate(prompts, NEW_TOKENS, force_tokens=forced(want, backend))
        assert_same_outputs(want, got, backend, f"round {names}")
        outs += got
    assert all(o.num_cached_tokens == 4 * B for o in outs[4:]), "warm rounds reuse it all"
    # the hazards were there: a device block offloaded, then written by an onboard, and a
    # host slot read by an onboard, then written by an offload, within one step's ops
    reused_block = reused_slot = False
    for batch in batches:
        for i, op in enumerate(batch):
            later = batch[i + 1:]
            if type(op) is BlockOffload:
                reused_block |= any(type(o) is BlockOnboard and o.dst == op.src for o in later)
            if type(op) is BlockOnboard:
                reused_slot |= any(type(o) is BlockOffload and o.dst == op.src for o in later)
    assert reused_block and reused_slot, "the scenario no longer interleaves the tiers"
    expect_reuse_across_tiers(scenario, engine, outs, NO_PARTIAL)


def test_a_window_model_keeps_full_bookkeeping_with_a_host_tier(
        make_engine: EngineFactory, scenario: ScenarioRun) -> None:
    """A sliding-window model (tiny-swa) with a host tier: the cache keeps full-attention
    bookkeeping (the host tier offloads leaves; windowed eviction would hollow interior
    blocks), and reuse through the host stays right."""
    B = 4
    prompts = shared_system_prompt(6, 3 * B, 5, num_groups=3, vocab=VOCAB, seed=4)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, preset="tiny-swa")
    engine = make_engine(B, mode=NO_PARTIAL, max_num_blocks=8, host_cache_blocks=32,
                         preset="tiny-swa")
    assert engine.cache_config.sliding_window is None
    assert engine.cache_config.host_cache_blocks == 32
    outs = engine.generate(prompts, NEW_TOKENS) + engine.generate(prompts, NEW_TOKENS)
    assert_same_outputs(reference + reference, outs, TORCH, "window model, through the host")
    expect_reuse_across_tiers(scenario, engine, outs, NO_PARTIAL)
