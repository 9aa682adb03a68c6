"""Proves a warm rerun reuses all but the last prompt token and equals the cold run.

The same prompts again reuse L - 1 tokens (partial reuse on) or floor((L-1)/B) full
blocks (off), for L % B in {0, 1, other}, L < B and L = 1.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from tests.scenarios.support import (
    ALL_BACKENDS,
    CPU_BACKENDS,
    MODES,
    BackendSpec,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    forced,
    prompts_of,
)

NEW_TOKENS = 3
# (tokens per block, prompt length): L = 1, L < B, L % B == 0, L % B == 1, another rest
CASES = [pytest.param(B, L, id=f"B{B}-L{L}") for B, L in [
    (1, 1), (1, 2), (1, 17),
    (2, 1), (2, 8), (2, 9),
    (4, 1), (4, 3), (4, 16), (4, 17), (4, 19),
    (16, 1), (16, 9), (16, 32), (16, 33), (16, 45),
    (64, 1), (64, 40), (64, 64), (64, 65), (64, 100),
]]


class Expected(NamedTuple):
    """Hand-computed reuse of one warm prompt."""

    tokens: int
    full_blocks: int
    partial_blocks: int
    claimed: bool  # the partial hit claims an idle leaf (else it is copied)

    @property
    def copied(self) -> bool:
        """The partial hit is a copy."""
        return self.partial_blocks == 1 and not self.claimed


def expected_warm(L: int, B: int, mode: ReuseMode) -> Expected:
    """What a warm prompt of L tokens reuses after the cold run cached it.

    The cold run committed C = L + NEW_TOKENS - 1 tokens (the last sampled token's KV is
    never computed), so the block holding the warm limit L - 1 is cached: it is an idle
    leaf (claimable) unless committed tokens run past it, and then only a copy reuses it.
    """
    limit = L - 1
    full = limit // B
    rest = limit - full * B
    committed = L + NEW_TOKENS - 1
    leaf = committed <= (full + 1) * B
    partial = rest > 0 and mode.partial and (leaf or mode.copy)
    return Expected(full * B + (rest if partial else 0), full, int(partial), partial and leaf)


@pytest.mark.parametrize(("B", "L"), CASES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_warm_reuses_all_but_the_last_token(make_engine: EngineFactory, scenario: ScenarioRun,
                                            backend: BackendSpec, mode: ReuseMode, B: int,
                                            L: int) -> None:
    engine = make_engine(B, backend=backend, mode=mode)
    prompts = prompts_of(L, [L, L, L])
    cold_stats = engine.kv_cache_stats()
    run = scenario.cold_warm(engine, prompts, NEW_TOKENS, backend, seed=L)
    assert [o.num_cached_tokens for o in run.cold] == [0, 0, 0]
    want = expected_warm(L, B, mode)
    got = [o.kv_metrics for o in run.warm]
    assert [m.num_reused_tokens if m else None for m in got] == [want.tokens] * 3
    assert [m.num_full_reused_blocks if m else None for m in got] == [want.full_blocks] * 3
    assert [m.num_partial_reused_blocks if m else None for m in got] == [want.partial_blocks] * 3
    assert [m.num_missed_blocks if m else None for m in got] == \
        [-(-L // B) - want.full_blocks - want.partial_blocks] * 3
    window = engine.kv_cache_stats().minus(cold_stats)
    assert (window.claimed_blocks, window.copied_blocks) == (3 * want.claimed, 3 * want.copied)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("B", [1, 4, 16])
def test_warm_twice_is_stable(make_engine: EngineFactory, scenario: ScenarioRun,
                              backend: BackendSpec, B: int) -> None:
    """A third run reuses as much as the second: claims and re-commits leave the cache
    as the cold run left it."""
    engine = make_engine(B, backend=backend)
    prompts = prompts_of(7, [5, 21, 38])
    run = scenario.cold_warm(engine, prompts, NEW_TOKENS, backend, seed=7)
    third = engine.generate(prompts, NEW_TOKENS, force_tokens=forced(run.cold, backend))
    assert [o.num_cached_tokens for o in third] == [o.num_cached_tokens for o in run.warm] \
        == [len(p) - 1 for p in prompts]
    assert_same_outputs(run.cold, third, backend, "third run vs cold")
    scenario.expect_oracle(engine, run.cold + run.warm + third, seed=7)
