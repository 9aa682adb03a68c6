"""Proves reuse over blocks stale to a sliding window (32) keeps outputs equal to a cold run.

Whole or chunked, with exactly the oracle's reuse.
"""

from __future__ import annotations

import random

import pytest

from kvcache.model import get_preset
from tests.scenarios.support import (
    ALL_BACKENDS,
    MODES,
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
