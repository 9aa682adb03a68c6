"""Proves a mid-block prefix claims an idle leaf, copies a busy or interior block, or is skipped.

Exactly as configured: claiming needs partial reuse, copying also copy_on_partial_reuse;
outputs equal a run without reuse.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest

from kvcache import Engine, GenerationOutput
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
    tokens,
    unlike,
)


class Situation(NamedTuple):
    """Request A, then request Q sharing A's first `full * B + B // 2` tokens.

    `full`: whole blocks Q shares with A; `a_tail`: A ends mid-block 2 (its tail becomes
    a partial leaf) rather than after 3 whole blocks; `running`: Q arrives while A still
    decodes (A holds its blocks); `claimable`: the block Q partially matches is then an
    idle leaf.
    """

    full: int
    a_tail: bool
    running: bool
    claimable: bool


SITUATIONS = [
    pytest.param(Situation(2, True, False, True), id="partial-leaf"),
    pytest.param(Situation(2, False, False, True), id="idle-leaf"),
    pytest.param(Situation(2, False, True, False), id="in-use"),
    pytest.param(Situation(1, False, False, False), id="non-leaf"),
]
Q_NEW = 2


def make_prompts(B: int, s: Situation, seed: int) -> tuple[list[int], list[int]]:
    """A (ending mid-block 2 with a partial tail, or on a block boundary after 3 blocks)
    and Q, which follows A for `s.full` blocks plus half a block, then diverges."""
    rng = random.Random(seed)
    half = B // 2
    a = tokens(rng, 2 * B + half + 1 if s.a_tail else 3 * B)
    cut = s.full * B + half
    return a, [*a[:cut], unlike(a[cut]), *tokens(rng, 3)]


def run_pair(engine: Engine, a: list[int], q: list[int], running: bool,
             force: list[list[int]] | None) -> list[GenerationOutput]:
    """A then Q: Q is queued after A's prefill step (A still running, 4 new tokens) or
    after A finished (1 new token: A commits exactly its prompt)."""
    a_new = 4 if running else 1
    ra = engine.add_request(a, a_new, force_tokens=force[0] if force else None)
    done = {o.request_id: o for o in engine.step()}
    if not running:
        while engine.has_unfinished():
            done |= {o.request_id: o for o in engine.step()}
    rq = engine.add_request(q, Q_NEW, force_tokens=force[1] if force else None)
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    return [done[ra], done[rq]]


@pytest.mark.parametrize("situation", SITUATIONS)
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mid_block_prefix_is_claimed_copied_or_skipped(
        make_engine: EngineFactory, scenario: ScenarioRun, backend: BackendSpec,
        mode: ReuseMode, B: int, situation: Situation) -> None:
    a, q = make_prompts(B, situation, seed=B)
    a_new = 4 if situation.running else 1
    reference = (make_engine.cold_reference(B, [a], a_new, backend=backend)
                 + make_engine.cold_reference(B, [q], Q_NEW, backend=backend))
    engine = make_engine(B, backend=backend, mode=mode)
    out = run_pair(engine, a, q, situation.running, forced(reference, backend))
    assert_same_outputs(reference, out, backend, "A, Q vs no reuse")

    partial = mode.partial and (situation.claimable or mode.copy)
    stats = engine.kv_cache_stats()
    assert out[1].num_cached_tokens == situation.full * B + (B // 2 if partial else 0)
    assert (stats.claimed_blocks, stats.copied_blocks) == (
        int(partial and situation.claimable), int(partial and not situation.claimable))
    scenario.expect_oracle(engine, out, seed=B)


@pytest.mark.parametrize("mode", MODES)
def test_siblings_in_one_step_share_one_copy_source(make_engine: EngineFactory,
                                                    scenario: ScenarioRun,
                                                    mode: ReuseMode) -> None:
    """Three requests diverging mid-block from one finished prompt, admitted together:
    each copies from the same interior block (copy on) or reuses full blocks only."""
    B = 4
    rng = random.Random(3)
    base = tokens(rng, 20)
    engine = make_engine(B, mode=mode)
    engine.generate([base], 1)
    qs = [[*base[:10], unlike(base[10]) + i, *tokens(rng, 4)] for i in range(3)]
    outs = engine.generate(qs, 3)
    reference = make_engine.cold_reference(B, qs, 3)
    assert_same_outputs(reference, outs, TORCH, "siblings vs no reuse")
    copies = mode.partial and mode.copy
    assert [o.num_cached_tokens for o in outs] == [10 if copies else 8] * 3
    assert engine.kv_cache_stats().copied_blocks == (3 if copies else 0)
    scenario.expect_oracle(engine, outs, seed=3)
