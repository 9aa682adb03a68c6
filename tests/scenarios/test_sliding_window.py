"""Proves a sliding window (32) keeps outputs equal to a cold run while the cache releases
what no later token sees: reuse over blocks stale to the window, whole or chunked, and
prompts 4x and 16x the window in a pool that holds only the window and one chunk, warm
after cold, with exactly the oracle's reuse. A model that interleaves full-attention
layers with the windowed ones (Gemma 2's pattern) keeps every block and reuses past the
window, as a full-attention cache would.
"""

from __future__ import annotations

import random

import pytest

from kvcache.core.window import peak_blocks
from kvcache.model import get_preset
from tests.scenarios.support import (
    ALL_BACKENDS,
    MODES,
    TORCH,
    BackendSpec,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    forced,
    prompts_of,
    tokens,
)

PRESET = "tiny-swa"
MIXED = "tiny-mixed-swa"  # windowed layers 0 and 2, full-attention layers 1 and 3
WINDOW = get_preset(PRESET).sliding_window
NEW_TOKENS = 3
BLOCKS = [pytest.param(B, id=f"B{B}") for B in (4, 16)]


def test_the_window_is_shorter_than_the_prompts() -> None:
    assert WINDOW is not None and WINDOW < 50


@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_warm_over_stale_blocks_equals_cold(make_engine: EngineFactory, scenario: ScenarioRun,
                                            backend: BackendSpec, mode: ReuseMode,
                                            B: int) -> None:
    prompts = prompts_of(B, [50, 65, 80])
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend,
                                           preset=PRESET)
    engine = make_engine(B, backend=backend, mode=mode, preset=PRESET)
    run = scenario.cold_warm(engine, prompts, NEW_TOKENS, backend, seed=B, reference=reference)
    assert all(o.num_cached_tokens > WINDOW for o in run.warm)


@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mixed_full_and_windowed_layers_warm_equals_cold(
        make_engine: EngineFactory, scenario: ScenarioRun, backend: BackendSpec,
        mode: ReuseMode, B: int) -> None:
    """The full-attention layers read every earlier key, so nothing is released and the
    warm prompts reuse blocks far outside the window; each layer attends with its own
    window through its own planned backend, and warm still equals cold."""
    prompts = prompts_of(B, [50, 65, 80])
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend,
                                           preset=MIXED)
    engine = make_engine(B, backend=backend, mode=mode, preset=MIXED)
    assert engine.cache_config.sliding_window is None
    run = scenario.cold_warm(engine, prompts, NEW_TOKENS, backend, seed=B, reference=reference)
    assert all(o.num_cached_tokens > WINDOW for o in run.warm)
    assert engine.kv_cache_stats().evicted_blocks == 0


@pytest.mark.parametrize("budget", [pytest.param(n, id=f"T{n}") for n in (7, 13)])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mixed_layers_chunked_under_eviction(make_engine: EngineFactory,
                                             scenario: ScenarioRun, backend: BackendSpec,
                                             budget: int) -> None:
    """The mixed-window model, prompts past the window prefilled in chunks one after
    another, in a pool of 24 blocks of 4 (the longest request needs 20): least recently
    used blocks are evicted between requests, outputs equal a run without reuse, and no
    admission reuses more than the unbounded oracle predicts."""
    B = 4
    rng = random.Random(budget)
    base = tokens(rng, 60)
    prompts = [base, base[:45] + tokens(rng, 30), tokens(rng, 50), base[:45] + tokens(rng, 12),
               base[:30] + tokens(rng, 40)]
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend,
                                           preset=MIXED)
    engine = make_engine(B, backend=backend, preset=MIXED, max_num_tokens=budget,
                         max_num_blocks=24)
    force = forced(reference, backend)
    outs = [engine.generate([p], NEW_TOKENS, force_tokens=force and force[i:i + 1])[0]
            for i, p in enumerate(prompts)]
    assert_same_outputs(reference, outs, backend, "mixed layers, chunked, evicting")
    stats = engine.kv_cache_stats()
    assert stats.evicted_blocks > 0 and stats.reused_blocks > 0
    assert outs[1].num_cached_tokens >= 44  # the first prompt's blocks, past the window
    scenario.expect_oracle(engine, outs, exact=False, seed=budget)


@pytest.mark.parametrize("budget", [pytest.param(n, id=f"T{n}") for n in (7, 13)])
@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_prefix_reused_past_the_window_chunked(make_engine: EngineFactory,
                                               scenario: ScenarioRun, backend: BackendSpec,
                                               B: int, budget: int) -> None:
    """Later prompts share a 45-token prefix with the first and then grow past the window,
    prefilled in chunks: the shared blocks they reuse are stale for their last tokens."""
    rng = random.Random(B + budget)
    base = tokens(rng, 60)
    prompts = [base, base[:45] + tokens(rng, 30), base[:45] + tokens(rng, 12)]
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend,
                                           preset=PRESET)
    engine = make_engine(B, backend=backend, preset=PRESET, max_num_tokens=budget)
    force = forced(reference, backend)
    first = engine.generate(prompts[:1], NEW_TOKENS, force_tokens=force and force[:1])
    rest = engine.generate(prompts[1:], NEW_TOKENS, force_tokens=force and force[1:])
    assert_same_outputs(reference, first + rest, backend, "chunked with reuse vs reference")
    assert [o.num_cached_tokens >= 45 // B * B for o in rest] == [True, True]
    scenario.expect_oracle(engine, first + rest, seed=B + budget)


@pytest.mark.parametrize("factor", [pytest.param(f, id=f"x{f}") for f in (4, 16)])
@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_long_prompt_runs_in_a_window_sized_pool(make_engine: EngineFactory,
                                                 scenario: ScenarioRun, backend: BackendSpec,
                                                 B: int, factor: int) -> None:
    """A prompt `factor` windows long, prefilled 16 tokens a step, in a pool of exactly the
    blocks the window and one chunk span: the prefill releases and evicts its early blocks
    as it goes, and the warm run still reuses all but the last token (its window survived)."""
    assert WINDOW is not None
    chunk = 16
    prompt = prompts_of(factor * B, [factor * WINDOW + 3])
    total = len(prompt[0]) + NEW_TOKENS
    pool = peak_blocks(len(prompt[0]), total, chunk, WINDOW - 1, B, reuse=True)
    assert 2 * pool <= -(-total // B)  # at most half the blocks the whole sequence spans
    reference = make_engine.cold_reference(B, prompt, NEW_TOKENS, backend=backend,
                                           preset=PRESET)
    engine = make_engine(B, backend=backend, preset=PRESET, max_num_blocks=pool,
                         max_num_tokens=chunk)
    run = scenario.cold_warm(engine, prompt, NEW_TOKENS, backend, seed=factor * B,
                             reference=reference)
    assert run.warm[0].num_cached_tokens == len(prompt[0]) - 1
    stats = engine.kv_cache_stats()
    assert stats.evicted_blocks >= -(-total // B) - pool  # the prefix is long gone
    tight = make_engine(B, backend=backend, preset=PRESET, max_num_blocks=pool - 1,
                        max_num_tokens=chunk)
    with pytest.raises(ValueError, match=f"needs {pool} blocks, the pool has only {pool - 1}"):
        tight.add_request(prompt[0], NEW_TOKENS)


@pytest.mark.parametrize("B", BLOCKS)
def test_release_off_keeps_every_block(make_engine: EngineFactory, scenario: ScenarioRun,
                                       B: int) -> None:
    """release_outside_window=False: full-attention bookkeeping, the same outputs, and a
    pool that must hold the whole sequence."""
    prompt = prompts_of(B, [4 * WINDOW + 3]) if WINDOW else []
    on = make_engine(B, preset=PRESET, max_num_tokens=16)
    off = make_engine(B, preset=PRESET, max_num_tokens=16, release_outside_window=False)
    assert (on.cache_config.sliding_window, off.cache_config.sliding_window) == (WINDOW, None)
    outs = [e.generate(prompt, NEW_TOKENS) for e in (on, off)]
    assert_same_outputs(outs[0], outs[1], TORCH, "release on vs off")
    scenario.expect_oracle(off, outs[1])
    with pytest.raises(ValueError, match="can never fit"):
        make_engine(B, preset=PRESET, max_num_tokens=16, release_outside_window=False,
                    max_num_blocks=-(-(len(prompt[0]) + NEW_TOKENS) // B) - 1,
                    ).add_request(prompt[0], NEW_TOKENS)


@pytest.mark.parametrize(("layout", "page_size"), [
    pytest.param("HND", 2, id="HND-p2"), pytest.param("BLHNC", None, id="BLHNC"),
    pytest.param("BLHNC", 2, id="BLHNC-p2")])
def test_released_blocks_in_every_layout(make_engine: EngineFactory, scenario: ScenarioRun,
                                         layout: str, page_size: int | None) -> None:
    """Release and window matching do not depend on how blocks are laid out or paged."""
    assert WINDOW is not None
    B, chunk = 4, 16
    prompt = prompts_of(7, [4 * WINDOW + 3])
    total = len(prompt[0]) + NEW_TOKENS
    pool = peak_blocks(len(prompt[0]), total, chunk, WINDOW - 1, B, reuse=True)
    reference = make_engine.cold_reference(B, prompt, NEW_TOKENS, preset=PRESET)
    engine = make_engine(B, preset=PRESET, max_num_blocks=pool, max_num_tokens=chunk,
                         layout=layout, page_size=page_size)
    run = scenario.cold_warm(engine, prompt, NEW_TOKENS, TORCH, seed=7, reference=reference)
    assert run.warm[0].num_cached_tokens == len(prompt[0]) - 1
