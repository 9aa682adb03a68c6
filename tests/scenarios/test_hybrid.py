"""Proves hybrid (attention + recurrent) models reuse prefixes through state snapshots.

The engine keeps each recurrent layer's state at the end of every k-th committed full
block and the cache aligns every match to those blocks: warm equals cold (tokens exact,
float32 logits within 1e-5: the recurrence's blocked scan rounds differently when it
resumes mid-prompt), the oracle predicts the aligned reuse exactly, across block sizes,
snapshot intervals, chunked prefill that ends chunks mid-block, eviction and scopes. With
a sliding window on the attention layers the cache releases what the window no longer
reaches, and warm prompts still resume from snapshots with the oracle's reuse.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvcache import Engine, GenerationOutput, ReuseScope
from kvcache.core.window import peak_blocks
from kvcache.model import Transformer, get_preset
from kvcache.model.transformer import Recurrence
from tests.scenarios.support import (
    CLAIM,
    TORCH,
    EngineFactory,
    ScenarioRun,
    assert_same_outputs,
    tokens,
)

PRESET = "hybrid-tiny"
NEW_TOKENS = 4


def family(seed: int, B: int) -> list[list[int]]:
    """A base prompt and prompts sharing 0, 1 block + 1, 2.5 and 3 blocks of it."""
    rng = random.Random(seed)
    base = tokens(rng, 4 * B + 3)
    return [base, base[:B + 1] + tokens(rng, 5), base[:5 * B // 2] + tokens(rng, B),
            base[:3 * B] + tokens(rng, 2), tokens(rng, 2 * B)]


def aligned(shared: int, length: int, B: int, k: int) -> int:
    """Tokens a prompt reuses: whole blocks of the shared prefix, never the last prompt
    token, cut back to a multiple of k blocks."""
    blocks = min(shared, length - 1) // B
    return (blocks - blocks % k) * B


@pytest.mark.parametrize("chunk", [pytest.param(512, id="whole"), pytest.param(7, id="chunk7")])
@pytest.mark.parametrize("k", [pytest.param(1, id="k1"), pytest.param(2, id="k2")])
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_warm_resumes_from_snapshots(make_engine: EngineFactory, scenario: ScenarioRun,
                                     B: int, k: int, chunk: int) -> None:
    prompts = family(B * k, B)
    engine = make_engine(B, preset=PRESET, max_num_tokens=chunk, state_snapshot_interval=k)
    assert engine.reuse_disabled_reason is None
    assert engine.cache_config.reuse_alignment_blocks == k
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, preset=PRESET)
    engine.generate(prompts[:1], NEW_TOKENS)  # the base prompt, cached with snapshots
    warm = engine.generate(prompts, NEW_TOKENS)
    for ref, out in zip(reference, warm, strict=True):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(out.logits, ref.logits, rtol=TORCH.atol, atol=TORCH.atol)
    base = prompts[0]
    shared = [len(base), B + 1, 5 * B // 2, 3 * B, 0]
    assert [o.num_cached_tokens for o in warm] == [
        aligned(s, len(p), B, k) for s, p in zip(shared, prompts, strict=True)]
    scenario.expect_oracle(engine, warm, seed=B * k)


SWA = "hybrid-tiny-swa"  # the same layers, attention within a 32-token window


def run_watching_release(engine: Engine, prompts: list[list[int]]
                         ) -> tuple[list[GenerationOutput], int]:
    """`generate` a step at a time; returns the outputs and the most blocks any running
    request had released at once (positions a window no longer reaches)."""
    rids = [engine.add_request(p, NEW_TOKENS) for p in prompts]
    done: dict[int, GenerationOutput] = {}
    most = 0
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
        for seq in engine.manager.sequences.values():
            most = max(most, sum(b is None for b in seq.block_ids))
    return [done[r] for r in rids], most


@pytest.mark.parametrize("chunk", [pytest.param(512, id="whole"), pytest.param(7, id="chunk7")])
@pytest.mark.parametrize("k", [pytest.param(1, id="k1"), pytest.param(2, id="k2")])
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_window_releases_and_warm_resumes_from_snapshots(
        make_engine: EngineFactory, scenario: ScenarioRun, B: int, k: int, chunk: int) -> None:
    """Recurrent layers beside windowed attention (RecurrentGemma's kind of model): the
    cache releases what the window no longer reaches while requests run, a released
    block stays cached with its snapshot, and warm prompts resume from the snapshot at
    the end of their aligned hit, inside the window: warm equals cold, exactly the
    oracle's reuse."""
    window = get_preset(SWA).sliding_window
    assert window is not None
    rng = random.Random(B * k + chunk)
    base = tokens(rng, 3 * window + 5)
    prompts = [base, base[:2 * window + 3] + tokens(rng, 9),
               base[:window // 2] + tokens(rng, 40), [*base, *tokens(rng, 3)]]
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, preset=SWA)
    engine = make_engine(B, preset=SWA, max_num_tokens=chunk, state_snapshot_interval=k)
    assert engine.cache_config.sliding_window == window and engine.snapshots is not None
    _, released = run_watching_release(engine, prompts[:1])
    assert released > 0, "the window released nothing"
    warm, _ = run_watching_release(engine, prompts)
    assert_same_outputs(reference, warm, TORCH, "warm past the window vs reference")
    shared = [len(base), 2 * window + 3, window // 2, len(base)]
    assert [o.num_cached_tokens for o in warm] == [
        aligned(s, len(p), B, k) for s, p in zip(shared, prompts, strict=True)]
    scenario.expect_oracle(engine, warm, seed=B * k)


@pytest.mark.parametrize("k", [pytest.param(1, id="k1"), pytest.param(2, id="k2")])
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_window_sized_pool_resumes_past_evicted_blocks(
        make_engine: EngineFactory, scenario: ScenarioRun, B: int, k: int) -> None:
    """A prompt four windows long, prefilled 16 tokens a step, in a pool of exactly the
    blocks the window and one chunk span: its early blocks (and their snapshots) are
    evicted as it goes. Warm, the same prompt is matched by its window and resumes from
    the snapshot at the end of the aligned hit, which survived with its block."""
    window = get_preset(SWA).sliding_window
    assert window is not None
    chunk = 16
    prompt = [tokens(random.Random(B * k), 4 * window + 3)]
    total = len(prompt[0]) + NEW_TOKENS
    pool = peak_blocks(len(prompt[0]), total, chunk, window - 1, B, reuse=True)
    assert 2 * pool <= -(-total // B)  # at most half the blocks the whole sequence spans
    reference = make_engine.cold_reference(B, prompt, NEW_TOKENS, preset=SWA)
    engine = make_engine(B, preset=SWA, max_num_blocks=pool, max_num_tokens=chunk,
                         state_snapshot_interval=k)
    run = scenario.cold_warm(engine, prompt, NEW_TOKENS, TORCH, seed=B * k,
                             reference=reference)
    assert run.warm[0].num_cached_tokens == aligned(len(prompt[0]), len(prompt[0]), B, k)
    assert run.warm[0].num_cached_tokens > len(prompt[0]) - window
    assert engine.kv_cache_stats().evicted_blocks >= -(-total // B) - pool
    # released and evicted blocks took their snapshots with them: none is left behind
    cached = {b for _, node in engine.manager.state.tree.walk() for b in node.blocks}
    assert engine.snapshots is not None and engine.snapshots._by_block
    assert set(engine.snapshots._by_block) <= cached


@pytest.mark.parametrize("k", [pytest.param(1, id="k1"), pytest.param(2, id="k2")])
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_snapshots_follow_their_blocks_to_the_host(make_engine: EngineFactory,
                                                   scenario: ScenarioRun, B: int,
                                                   k: int) -> None:
    """A device pool of about one request, a host tier 8x it: between the rounds every
    family's prefix goes to the host with its snapshots and comes back for the next warm
    prompt, which resumes from the onboarded snapshot. Warm equals cold, offloads and
    onboards happen, the bounded oracle predicts every count, and every snapshot is kept
    for a block of the tree (on the device, or by its host slot)."""
    prompts = family(B * k + 1, B) + family(B * k + 2, B)
    per_request = -(-(max(map(len, prompts)) + NEW_TOKENS) // B)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, preset=PRESET)
    engine = make_engine(B, preset=PRESET, max_num_blocks=per_request + 1,
                         host_cache_blocks=8 * (per_request + 1), state_snapshot_interval=k,
                         max_batch_size=1)
    outs: list[GenerationOutput] = []
    for round_ in range(2):
        got = [engine.generate([p], NEW_TOKENS)[0] for p in prompts]
        assert_same_outputs(reference, got, TORCH, f"round {round_} through the host")
        outs += got
    stats = engine.kv_cache_stats()
    assert stats.offloaded_blocks > 0 and stats.onboarded_blocks > 0, stats
    assert sum(o.num_cached_tokens for o in outs[len(prompts):]) > 0
    snapshots = engine.snapshots
    assert snapshots is not None and snapshots.offloaded_slots
    device, host = set(), set()
    for _, node in engine.manager.state.tree.walk():
        (host if node.host else device).update(node.blocks)
    assert set(snapshots._by_block) <= device and snapshots.offloaded_slots <= host
    scenario.expect_oracle(engine, outs, seed=B * k, bounded=True)


@pytest.mark.parametrize("k", [1, 3])
def test_snapshots_live_and_die_with_their_blocks(make_engine: EngineFactory,
                                                  scenario: ScenarioRun, k: int) -> None:
    B = 4
    engine = make_engine(B, preset=PRESET, max_num_blocks=12, state_snapshot_interval=k)
    rng = random.Random(k)
    prompts = [tokens(rng, 17) for _ in range(4)]  # 5 blocks each: the pool holds two
    for p in prompts:
        engine.generate([p], NEW_TOKENS)
        snapshots = engine.snapshots
        assert snapshots is not None
        # every cached full block at a snapshot position has one, nothing else does
        due = {b for _, node in engine.manager.state.tree.walk() for b in _snapshot_blocks(
            engine, node, k)}
        assert set(snapshots._by_block) == due
        assert engine.kv_cache_stats().state_snapshot_bytes == len(due) * 4 * 128
    # eviction dropped the first prompts: warm runs of them are cold again, and correct
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, preset=PRESET)
    outs = [engine.generate([p], NEW_TOKENS)[0] for p in prompts]
    for ref, out in zip(reference, outs, strict=True):
        assert out.token_ids == ref.token_ids
    assert engine.kv_cache_stats().evicted_blocks > 0
    scenario.expect_full_blocks_bounded(engine, outs, seed=k)


def _snapshot_blocks(engine: Engine, node: object, k: int) -> list[int]:
    """Block ids of `node` that end a multiple of k blocks from the root."""
    depth, up = 0, node.parent  # type: ignore[attr-defined]
    while up is not None and up.parent is not None:
        depth += len(up.blocks)
        up = up.parent
    blocks = node.blocks  # type: ignore[attr-defined]
    full = len(node.key) // 4 == len(blocks) * engine.cache_config.tokens_per_block  # type: ignore[attr-defined]
    return [b for i, b in enumerate(blocks) if full and (depth + i + 1) % k == 0]


def test_scopes_never_share_snapshots(make_engine: EngineFactory,
                                      scenario: ScenarioRun) -> None:
    B = 4
    engine = make_engine(B, preset=PRESET)
    prompt = tokens(random.Random(3), 21)
    a, b = ReuseScope(salt="a"), ReuseScope(salt="b")
    engine.generate([prompt], NEW_TOKENS, [a])
    outs = engine.generate([prompt, prompt], NEW_TOKENS, [a, b])
    assert [o.num_cached_tokens for o in outs] == [20, 0]
    assert outs[0].token_ids == outs[1].token_ids
    scenario.expect_oracle(engine, outs, seed=3)


def test_explicit_reuse_works_and_partial_reuse_is_refused(make_engine: EngineFactory) -> None:
    engine = make_engine(4, preset=PRESET, reuse=True)
    assert engine.cache_config.block_reuse and not engine.cache_config.partial_reuse
    with pytest.raises(ValueError, match=r"enable_partial_reuse=True is unsupported for a "
                                         r"model with recurrent layers \(layers \[1\]\)"):
        make_engine(4, preset=PRESET, mode=CLAIM)
    with pytest.raises(ValueError, match="state_snapshot_interval must be an int >= 1"):
        make_engine(4, preset=PRESET, reuse=True, state_snapshot_interval=0)
    assert make_engine.created == [engine]  # a refused engine is not kept


class _Opaque(Recurrence):
    """A recurrent layer whose state the engine cannot snapshot."""

    supports_snapshots = False


def opaque_hybrid(seed: int) -> Transformer:
    """The hybrid preset with recurrent layers that cannot be snapshotted (a repro file
    names this builder, so a replay builds the same model)."""
    model = Transformer(get_preset(PRESET), seed=seed)
    for block in model.layers:
        if isinstance(block.mixer, Recurrence):
            block.mixer.__class__ = _Opaque
    return model


def test_a_model_without_snapshots_keeps_reuse_off(make_engine: EngineFactory) -> None:
    engine = make_engine(4, preset=opaque_hybrid)
    assert engine.recipe.preset == "tests.scenarios.test_hybrid:opaque_hybrid"
    assert not engine.cache_config.block_reuse and engine.snapshots is None
    assert "cannot be snapshotted" in (engine.reuse_disabled_reason or "")
    with pytest.raises(ValueError, match="enable_block_reuse=True is unsupported"):
        make_engine(4, preset=opaque_hybrid, reuse=True)
