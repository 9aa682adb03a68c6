"""Proves chunked prefill with reuse equals unchunked prefill, with oracle-exact reuse.

Chunks cut blocks and cached prefixes anywhere, a request reuses blocks another request
committed in an earlier chunk while still in prefill, and the budget may be under one
block; the admission log carries every chunk's commit.
"""

from __future__ import annotations

import random

import pytest

from harness.workloads import shared_system_prompt
from tests.scenarios.support import (
    ALL_BACKENDS,
    CPU_BACKENDS,
    MODES,
    VOCAB,
    BackendSpec,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    forced,
    tokens,
)

NEW_TOKENS = 3


@pytest.mark.parametrize("budget", [pytest.param(n, id=f"T{n}") for n in (3, 7, 13)])
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_chunks_cut_blocks_and_cached_prefixes(make_engine: EngineFactory,
                                               scenario: ScenarioRun, backend: BackendSpec,
                                               mode: ReuseMode, B: int, budget: int) -> None:
    prompts = shared_system_prompt(4, 23, 9, vocab=VOCAB, seed=budget)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend)
    engine = make_engine(B, backend=backend, mode=mode, max_num_tokens=budget)
    force = forced(reference, backend)
    cold = engine.generate(prompts, NEW_TOKENS, force_tokens=force)
    warm = engine.generate(prompts, NEW_TOKENS, force_tokens=force)
    assert_same_outputs(reference, cold, backend, "chunked cold vs unchunked")
    assert_same_outputs(reference, warm, backend, "chunked warm vs unchunked")
    # the block holding token 31 is followed by the cold run's tail: copied, never claimed
    assert [o.num_cached_tokens for o in warm] == [31 if mode.copy else 31 // B * B] * 4
    scenario.expect_oracle(engine, cold + warm, seed=budget)


@pytest.mark.parametrize("share", [pytest.param(True, id="share"),
                                   pytest.param(False, id="noshare")])
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_reuse_of_blocks_committed_by_a_request_still_in_prefill(
        make_engine: EngineFactory, scenario: ScenarioRun, backend: BackendSpec,
        B: int, share: bool) -> None:
    rng = random.Random(B)
    a = tokens(rng, 30)
    q = a[:28] + tokens(rng, 5)
    reference = make_engine.cold_reference(B, [a, q], NEW_TOKENS, backend=backend)
    engine = make_engine(B, backend=backend, max_num_tokens=12, share_prefixes=share)
    force = forced(reference, backend)
    ra = engine.add_request(a, NEW_TOKENS, force_tokens=force[0] if force else None)
    rq = engine.add_request(q, NEW_TOKENS, force_tokens=force[1] if force else None)
    engine.step()
    engine.step()  # A has run two 12-token chunks; Q waits for budget
    assert engine.manager.sequences[ra].num_committed_tokens == 24
    assert rq not in engine.manager.sequences
    # A's last 6 tokens; without sharing Q is admitted beside them, with it Q waits for
    # A to commit the full blocks they share
    done = {o.request_id: o for o in engine.step()}
    assert engine.manager.sequences[ra].num_committed_tokens == 30
    assert (rq in engine.manager.sequences) is (not share or 28 // B * B == 24 // B * B)
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    out = [done[ra], done[rq]]
    assert_same_outputs(reference, out, backend, "A, Q vs no reuse")
    # without sharing Q saw only what A had committed before that step (its first 24
    # tokens' full blocks); with it, every full block of their 28 shared tokens
    assert out[1].num_cached_tokens == (28 if share else 24) // B * B
    scenario.expect_oracle(engine, out, seed=B)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_budget_smaller_than_one_block(make_engine: EngineFactory, scenario: ScenarioRun,
                                       backend: BackendSpec) -> None:
    B, budget = 16, 5
    engine = make_engine(B, backend=backend, max_num_tokens=budget)
    prompts = [tokens(random.Random(5), 40)]
    run = scenario.cold_warm(engine, prompts, NEW_TOKENS, backend, seed=5)
    commits = [e["num_tokens"] for e in engine.admission_log()
               if e["kind"] == "commit" and e["seq_id"] == run.cold[0].request_id]
    assert commits[:8] == list(range(5, 41, 5))  # one 5-token chunk a step
    assert run.warm[0].num_cached_tokens == 39
