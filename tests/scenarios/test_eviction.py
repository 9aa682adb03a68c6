"""Proves eviction under pressure keeps outputs right, spares live blocks, follows LRU and priority.

With a pool smaller than the working set outputs equal a run without reuse, blocks a live
request references are never evicted, the least recently used idle prefix of the lowest
retention priority goes first (a prefix several requests held at several priorities has
the highest of theirs since it was last unreferenced), and full-block reuse never exceeds
the unbounded oracle. With partial reuse off the bounded oracle, which models the pool
and retention priority, predicts every count exactly, evictions included.
"""

from __future__ import annotations

import random

import pytest

from harness.workloads import shared_system_prompt
from kvcache import DEFAULT_PRIORITY, Engine, GenerationOutput
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

NEW_TOKENS = 4
# (tokens per block, pool blocks): each pool holds a fraction of the working set
POOLS = [pytest.param(B, n, id=f"B{B}-pool{n}") for B, n in ((2, 36), (4, 16), (16, 4))]


def run_all(engine: Engine, prompts: list[list[int]], new: int) -> list[GenerationOutput]:
    """`generate`, plus a check after every step that no block two live requests hold is
    anything but a cached block both reference (an evicted or reused block would be)."""
    rids = [engine.add_request(p, new) for p in prompts]
    done: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
        assert_live_blocks_unshared(engine)
    return [done[r] for r in rids]


def assert_live_blocks_unshared(engine: Engine) -> None:
    """Every block a live sequence holds is off the free list; a block in two live
    sequences must be a cached (tree) block of both."""
    mgr = engine.manager
    free = set(mgr.state.pool.free)
    owner: dict[int, tuple[object, bool]] = {}
    for sid, seq in mgr.sequences.items():
        tree_blocks = seq.holdings.tree_blocks
        for pos, block in enumerate(seq.block_ids):
            if block is None:  # released by a sliding window: held by nobody here
                continue
            cached = pos < tree_blocks
            assert block not in free, f"request {sid!r} holds block {block}, which is free"
            other = owner.setdefault(block, (sid, cached))
            if other[0] != sid:
                assert cached and other[1], (
                    f"block {block} is held by requests {other[0]!r} and {sid!r}, "
                    "not as a shared cached block")


@pytest.mark.parametrize(("B", "blocks"), POOLS)
@pytest.mark.parametrize("mode", MODES)
def test_pool_smaller_than_working_set(make_engine: EngineFactory, scenario: ScenarioRun,
                                       mode: ReuseMode, B: int, blocks: int) -> None:
    prompts = shared_system_prompt(9, 18, 5, num_groups=3, vocab=VOCAB, seed=B)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS)
    engine = make_engine(B, mode=mode, max_num_blocks=blocks)
    outs: list[GenerationOutput] = []
    for shift in range(3):  # three rounds, each in another order
        order = prompts[shift:] + prompts[:shift]
        got = run_all(engine, order, NEW_TOKENS)
        assert_same_outputs(reference[shift:] + reference[:shift], got, TORCH,
                            f"round {shift} vs no reuse")
        outs += got
    stats = engine.kv_cache_stats()
    assert stats.evicted_blocks > 0 and stats.reused_blocks > 0
    if mode == NO_PARTIAL:  # the bounded oracle models the pool: exact
        scenario.expect_oracle(engine, outs, seed=B, bounded=True)
    else:
        scenario.expect_full_blocks_bounded(engine, outs, seed=B)


@pytest.mark.parametrize("mode", MODES)
def test_referenced_blocks_are_never_evicted(make_engine: EngineFactory,
                                             scenario: ScenarioRun, mode: ReuseMode) -> None:
    B = 4
    rng = random.Random(11)
    long_runner = tokens(rng, 14)
    churn = [long_runner[:6] + tokens(rng, 6) for _ in range(8)]  # partly shared prefix
    reference = (make_engine.cold_reference(B, [long_runner], 24)
                 + make_engine.cold_reference(B, churn, 2))
    engine = make_engine(B, mode=mode, max_num_blocks=12, max_batch_size=3)
    rid = engine.add_request(long_runner, 24)  # holds up to 10 blocks while churn cycles
    held: list[int] = []
    churn_rids = [engine.add_request(p, 2) for p in churn]
    done: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
        assert_live_blocks_unshared(engine)
        if rid in engine.manager.sequences:
            now = list(engine.manager.sequences[rid].block_ids)
            assert now[:len(held)] == held, "the long request's blocks changed under it"
            held = now
    assert done[rid].num_preemptions == 0
    assert_same_outputs(reference, [done[rid], *(done[r] for r in churn_rids)], TORCH,
                        "long request and churn vs no reuse")
    assert engine.kv_cache_stats().evicted_blocks > 0
    scenario.expect_full_blocks_bounded(engine, [done[rid], *(done[r] for r in churn_rids)])


def run_one(engine: Engine, prompt: list[int], priority: int = DEFAULT_PRIORITY
            ) -> GenerationOutput:
    """One request to completion; probe_reuse must predict its admission exactly."""
    probed = engine.manager.probe_reuse(prompt)
    engine.add_request(prompt, 1, priority=priority)
    outs: list[GenerationOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].num_cached_tokens == probed, "probe_reuse differs from the admission"
    return outs[0]


@pytest.mark.parametrize(("y_priority", "survivors"), [
    pytest.param(DEFAULT_PRIORITY, "XZ", id="lru"),
    pytest.param(80, "XY", id="priority"),
])
def test_lru_and_retention_priority_choose_the_victim(
        make_engine: EngineFactory, scenario: ScenarioRun, y_priority: int,
        survivors: str) -> None:
    """X, Y, Z (3 blocks each) fill 9 of 10 blocks; X is used again; W needs 3 blocks, so
    2 are evicted from the least recently used idle prefix of the lowest priority: Y,
    or Z when Y was admitted with a higher retention priority."""
    B = 4
    x, y, z, w = (tokens(random.Random(s), 3 * B) for s in range(4))
    engine = make_engine(B, mode=NO_PARTIAL, max_num_blocks=10)
    outs = [run_one(engine, x), run_one(engine, y, y_priority), run_one(engine, z),
            run_one(engine, x), run_one(engine, w)]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 2 * B, 0]
    assert engine.kv_cache_stats().evicted_blocks == 2
    # the victim keeps its first block; the others still match all but the last token
    probes = {name: engine.manager.probe_reuse(p) for name, p in zip("XYZ", (x, y, z),
                                                                       strict=True)}
    assert probes == {n: 2 * B if n in survivors else B for n in "XYZ"}
    scenario.expect_oracle(engine, outs, bounded=True)


def run_together(engine: Engine, requests: list[tuple[list[int], int, int]]
                 ) -> list[GenerationOutput]:
    """Queue every (prompt, max new tokens, priority) at once and step to completion;
    outputs in request order."""
    rids = [engine.add_request(p, n, priority=prio) for p, n, prio in requests]
    done: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    return [done[r] for r in rids]


@pytest.mark.parametrize("overlap", ["while-held", "after-release"])
def test_a_prefix_re_held_at_a_lower_priority_under_pressure(
        make_engine: EngineFactory, scenario: ScenarioRun, overlap: str) -> None:
    """A (priority 80) computes prefix P; B (10) reuses P and adds a block of its own;
    F (35) is cached after them; then W needs four blocks the free list cannot give.

    - while-held: B is admitted while A still runs, so P's priority is the higher of
      theirs, 80: W evicts B's block and F's three, and P survives.
    - after-release: A has left before B re-holds P, so P starts again from B's 10: W
      evicts B's block and P, then one of F's blocks, although F is younger.

    Outputs equal a run without reuse, and the bounded oracle, which models retention
    priority, predicts every count exactly (evictions included)."""
    B = 4
    rng = random.Random(22)
    p = tokens(rng, 2 * B)
    a, b = [*p, *tokens(rng, 1)], [*p, *tokens(rng, B + 1)]
    f, w = tokens(rng, 3 * B + 1), tokens(rng, 5 * B + 1)
    engine = make_engine(B, mode=NO_PARTIAL, max_num_blocks=8)
    first, second = (a, 2, 80), (b, 1, 10)
    if overlap == "while-held":  # B waits for A to commit P, then joins it
        outs = run_together(engine, [first, second])
    else:
        outs = run_together(engine, [first]) + run_together(engine, [second])
    assert [o.num_cached_tokens for o in outs] == [0, 2 * B]
    outs += [run_one(engine, f), run_one(engine, w)]
    assert outs[3].num_cached_tokens == 0
    assert engine.kv_cache_stats().evicted_blocks == 4
    probes = [engine.manager.probe_reuse(x) for x in (a, b, f)]
    assert probes == ([2 * B, 2 * B, 0] if overlap == "while-held" else [0, 0, 2 * B])
    reference = (make_engine.cold_reference(B, [a], 2)
                 + make_engine.cold_reference(B, [b, f, w], 1))
    assert_same_outputs(reference, outs, TORCH, "re-held prefix vs no reuse")
    scenario.expect_oracle(engine, outs, bounded=True)
