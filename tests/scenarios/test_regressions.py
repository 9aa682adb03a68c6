"""Proves bugs other engines shipped, and ours, stay fixed: boundary over-credit, chunk
token counts, aliasing, unwritten and stale KV.

A prompt ending exactly on a block boundary never has its last token credited as reused,
chunked prefill with reuse stores blocks holding exactly their tokens, a partially
reused block never aliases a page that another live request writes, reused tokens are
written before they are read, and a commit that switches a request to an equal cached
block rewrites its block table before the block it gave back is written again.
"""

from __future__ import annotations

import random

import pytest

from harness.oracle import ShadowStore
from kvcache import Engine, GenerationOutput, KvCacheManager
from kvcache.core.keys import TOKEN_BYTES
from tests.scenarios.support import (
    COPY,
    MODES,
    TORCH,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    prompts_of,
    tokens,
    unlike,
)

NEW_TOKENS = 3


@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (1, 2, 4, 16, 64)])
@pytest.mark.parametrize("mode", MODES)
def test_block_boundary_prompt_never_over_credits(make_engine: EngineFactory,
                                                  scenario: ScenarioRun, mode: ReuseMode,
                                                  B: int) -> None:
    """Prompts of 2B tokens: the same prompt cached, or a prefix of a cached longer one.
    Both must reuse at most 2B - 1 tokens, never the second whole block."""
    long = prompts_of(B, [3 * B + 5])[0]
    same = prompts_of(B + 1, [2 * B])[0]
    engine = make_engine(B, mode=mode)
    # one new token: `same` commits exactly its prompt, its second block an idle leaf;
    # long[:2B]'s second block has followers
    cold = engine.generate([long], NEW_TOKENS) + engine.generate([same], 1)
    warm = engine.generate([long[:2 * B], same], NEW_TOKENS)
    copied = mode.partial and mode.copy
    want = [2 * B - 1 if copied else B, 2 * B - 1 if mode.partial else B]
    assert [o.num_cached_tokens for o in warm] == want
    for out in warm:
        assert out.kv_metrics is not None and out.kv_metrics.num_full_reused_blocks == 1
    reference = make_engine.cold_reference(B, [long[:2 * B], same], NEW_TOKENS)
    assert_same_outputs(reference, warm, TORCH, "boundary prompts vs reference")
    scenario.expect_oracle(engine, cold + warm, seed=B)


def tree_problems(manager: KvCacheManager) -> list[str]:
    """Nodes whose token count is not their blocks' capacity, unless a partial leaf."""
    B = manager.state.config.tokens_per_block
    out = []
    for scope, node in manager.state.tree.walk():
        n = len(node.key) // TOKEN_BYTES
        if n == len(node.blocks) * B:
            continue
        if not (len(node.blocks) == 1 and 0 < n < B and not node.children):
            out.append(f"scope {scope!r}: {node!r} holds {n} tokens in {len(node.blocks)} "
                       f"blocks of {B}")
    return out


def assert_tree_holds_committed_tokens(engine: Engine) -> None:
    """Every live sequence's committed full blocks are cached with exactly its tokens."""
    B = engine.cache_config.tokens_per_block
    for sid, seq in engine.manager.sequences.items():
        full = seq.num_committed_tokens // B * B
        if full == 0 or full == len(seq.tokens):
            continue
        probe = [*seq.tokens[:full], unlike(seq.tokens[full])]
        assert engine.manager.probe_reuse(probe, None) == full, (
            f"request {sid!r} committed {seq.num_committed_tokens} tokens, the tree "
            f"matches its first {engine.manager.probe_reuse(probe, None)} of {full}\n"
            f"{engine.manager.state.tree.dump()}")


@pytest.mark.parametrize("budget", [pytest.param(n, id=f"T{n}") for n in (3, 5, 7)])
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_chunked_prefill_stores_blocks_with_their_tokens(make_engine: EngineFactory,
                                                         scenario: ScenarioRun, B: int,
                                                         budget: int) -> None:
    rng = random.Random(B * budget)
    base = tokens(rng, 2 * B + 3)
    prompts = [base, base[:B + 2] + tokens(rng, B + 1), tokens(rng, B + 5)]
    engine = make_engine(B, mode=COPY, max_num_tokens=budget)
    rids = [engine.add_request(p, NEW_TOKENS) for p in prompts]
    done: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
        assert tree_problems(engine.manager) == []
        assert_tree_holds_committed_tokens(engine)
    outs = [done[r] for r in rids]
    # each finished request's committed tokens, tail included, match in full again
    for out in outs:
        committed = list(out.prompt) + out.token_ids[:-1]
        assert engine.manager.probe_reuse([*committed, 1]) == len(committed)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS)
    assert_same_outputs(reference, outs, TORCH, "chunked with reuse vs reference")
    scenario.expect_oracle(engine, outs, seed=B * budget)


@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_partial_copy_never_aliases_a_live_block(make_engine: EngineFactory,
                                                 scenario: ScenarioRun, B: int) -> None:
    """A decodes (writing its own blocks) while Q1 and Q2 copy the start of A's last
    cached block: the copies land in fresh blocks, distinct from each other and from
    every block A holds; only whole shared blocks are held in common."""
    rng = random.Random(B)
    a = tokens(rng, 3 * B)
    qs = [a[:2 * B + 2] + tokens(rng, 4), a[:2 * B + 1] + tokens(rng, 5)]
    reference = (make_engine.cold_reference(B, [a], 2 * B)
                 + make_engine.cold_reference(B, qs, NEW_TOKENS))
    engine = make_engine(B, mode=COPY)
    ra = engine.add_request(a, 2 * B)
    done = {o.request_id: o for o in engine.step()}  # A's prefill: blocks 0-2 cached
    rq = [engine.add_request(q, NEW_TOKENS) for q in qs]
    done |= {o.request_id: o for o in engine.step()}  # A decodes, Q1 and Q2 admitted
    seq_a, *seq_q = (engine.manager.sequences[r] for r in (ra, *rq))
    assert [s.num_cached_tokens for s in seq_q] == [2 * B + 2, 2 * B + 1]
    assert engine.kv_cache_stats().copied_blocks == 2
    for i, s in enumerate(seq_q):
        assert s.block_ids[:2] == seq_a.block_ids[:2]  # whole blocks: shared, read-only
        others = set(seq_a.block_ids) | set(seq_q[1 - i].block_ids)
        assert not set(s.block_ids[2:]) & others, (
            f"Q{i + 1}'s blocks {s.block_ids} overlap A's {seq_a.block_ids} or the other Q's")
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    outs = [done[r] for r in (ra, *rq)]
    assert_same_outputs(reference, outs, TORCH, "A, Q1, Q2 vs reference")
    scenario.expect_oracle(engine, outs, seed=B)


def test_reused_tokens_of_an_aborted_copy_are_written_before_read(
        make_engine: EngineFactory, scenario: ScenarioRun) -> None:
    """The cache-level example of a sequence freed with its copy pending, through the
    engine: 4 tokens a block, 4 blocks. B copies 3 tokens of A's block, C's admission
    evicts the source, B is aborted, D reuses what B left. The engine applies each copy
    before the forward pass of the step that queued it, so whatever D reuses was written:
    warm equals cold, and the provenance oracle replaying the log finds every read right."""
    prompts = {"A": [1, 2, 2, 2, 0], "B": [1, 2, 2, 0, 1], "C": [7] * 5, "D": [1, 2, 2, 9]}
    engine = make_engine(4, mode=COPY, max_num_blocks=4)
    outs = engine.generate([prompts["A"]], 1)
    rb = engine.add_request(prompts["B"], 3)
    engine.step()  # B admitted: copies 3 tokens of [1, 2, 2, 2]
    assert engine.kv_cache_stats().copied_blocks == 1
    rc = engine.add_request(prompts["C"], 1)
    done = {o.request_id: o for o in engine.step()}  # C evicts the copy source
    assert engine.kv_cache_stats().evicted_blocks >= 2
    engine.abort(rb)
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    outs += [done[rc], *engine.generate([prompts["D"]], 1)]
    assert outs[-1].num_cached_tokens == 3
    reference = make_engine.cold_reference(4, [prompts[k] for k in "ACD"], 1)
    assert_same_outputs(reference, outs, TORCH, "A, C, D vs reference")
    shadow = ShadowStore(4)
    shadow.replay(engine.manager.state.events or ())
    assert shadow.num_slots_checked > 0
    scenario.expect_oracle(engine, outs, exact=False)


def test_a_deduplicated_commit_rewrites_the_block_table(make_engine: EngineFactory,
                                                        scenario: ScenarioRun) -> None:
    """X and Y compute the same prompt in one step (in-batch prefix sharing off), Y in a
    chunk that stops after one block (no token sampled). X commits that block first, so Y's commit switches Y to
    X's block and gives its own back; in the next step Z is admitted into the block Y
    gave back and writes it while Y reads its first block. Y's row of the block table
    must point at X's block by then, or Y attends over Z's KV."""
    rng = random.Random(5)
    p, z = tokens(rng, 6), tokens(rng, 8)
    engine = make_engine(4, mode=COPY, max_num_tokens=10, max_batch_size=3,
                         share_prefixes=False)  # both compute the prompt: a dedup
    rx, ry, rz = (engine.add_request(q, 4) for q in (p, p, z))
    done = {o.request_id: o for o in engine.step()}  # X: 6 tokens, Y: 4 (budget 10)
    y = engine.manager.sequences[ry]
    x_blocks = list(engine.manager.sequences[rx].block_ids)
    assert (y.num_committed_tokens, y.block_ids_version) == (4, 1)
    assert y.block_ids[0] == x_blocks[0] and rz not in engine.manager.sequences
    given_back = engine.manager.state.pool.free[-1]
    done |= {o.request_id: o for o in engine.step()}  # Z takes the block Y gave back
    assert given_back in engine.manager.sequences[rz].block_ids
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    outs = [done[r] for r in (rx, ry, rz)]
    reference = make_engine.cold_reference(4, [p, p, z], 4)
    assert_same_outputs(reference, outs, TORCH, "X, Y, Z vs reference")
    scenario.expect_oracle(engine, outs)
