"""The manager under a sliding window: release at commit, blocks reserved chunk by chunk,
hollow path nodes after eviction, and the window hit rule."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

import pytest

from kvcache import KvCacheConfig, KvCacheManager
from kvcache.core.handle import SequenceHandle
from kvcache.core.integrity import IntegrityError
from kvcache.core.window import peak_blocks

W, B, CHUNK = 8, 4, 8  # window 8 (window_left 7), blocks of 4 tokens


def _manager(blocks: int = 64, **options: object) -> KvCacheManager:
    return KvCacheManager(KvCacheConfig(tokens_per_block=B, max_num_blocks=blocks,
                                        sliding_window=W, **options))  # type: ignore[arg-type]


def _prompt(n: int, seed: int = 1) -> list[int]:
    return random.Random(seed).choices(range(1, 100), k=n)


def _run(mgr: KvCacheManager, sid: Hashable, tokens: Sequence[int],
         chunk: int = CHUNK) -> SequenceHandle:
    """Admit `tokens` and compute them chunk by chunk, as the engine does."""
    seq = mgr.admit(sid, mgr.plan_admission(tokens, first_chunk=chunk))
    done = seq.num_cached_tokens
    while done < len(tokens):
        done = mgr.reserve(sid, min(len(tokens), done + chunk))
        mgr.commit(sid, done)
        mgr.check_integrity()
    return seq


def _cold_run_on_the_smallest_pool(prompt: Sequence[int]) -> KvCacheManager:
    """A manager whose pool is the prompt's peak, after a cold run of it was freed: the
    run evicted its first blocks, so their path is hollow."""
    mgr = _manager(blocks=peak_blocks(len(prompt), len(prompt), CHUNK, W - 1, B, reuse=True))
    _run(mgr, "cold", prompt)
    mgr.free_sequence("cold")
    return mgr


def _hollow_tokens(mgr: KvCacheManager) -> int:
    return sum(len(node.key) // 4 for _, node in mgr.state.tree.walk() if not node.blocks)


def test_commit_releases_blocks_outside_the_window_and_they_stay_cached() -> None:
    mgr = _manager()
    seq = mgr.add_sequence("a", _prompt(40))
    mgr.commit("a", 16)  # position 16 sees 9..16: blocks 0 and 1 are out of reach
    assert seq.num_released_blocks == 2 and list(seq.block_ids[:2]) == [None, None]
    assert mgr.stats().used_num_blocks == 8  # the released two are cached and evictable
    mgr.commit("a", 40)
    assert seq.num_released_blocks == 8 and seq.live_block_ids() == list(seq.block_ids[8:])
    mgr.check_integrity()
    mgr.free_sequence("a")
    stats = mgr.stats()
    assert (stats.used_num_blocks, stats.cached_num_blocks) == (0, 10)


def test_without_reuse_released_blocks_go_back_to_the_free_list() -> None:
    mgr = _manager(enable_block_reuse=False)
    seq = mgr.add_sequence("a", _prompt(40))
    free = mgr.state.pool.num_free
    mgr.commit("a", 24)  # blocks 0..3 out of reach
    assert seq.num_released_blocks == 4 and mgr.state.pool.num_free == free + 4
    mgr.check_integrity()
    mgr.free_sequence("a")
    assert mgr.state.pool.num_free == 64


def test_a_window_inside_a_block_keeps_the_deepest_cached_block() -> None:
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=B, max_num_blocks=16, sliding_window=1))
    seq = mgr.add_sequence("a", _prompt(20))
    mgr.commit("a", 16)  # position 16 sees only itself, yet block 3 is where commits hang
    assert seq.num_released_blocks == 3 and seq.holdings.last is not None
    assert seq.holdings.last.ref == 1
    mgr.check_integrity()
    mgr.free_sequence("a")


def test_prompt_blocks_are_reserved_chunk_by_chunk() -> None:
    mgr = _manager(blocks=6)
    plan = mgr.plan_admission(_prompt(40), first_chunk=CHUNK)
    assert (plan.num_new_blocks, plan.fits) == (2, True)
    assert mgr.plan_admission(_prompt(40)).fits is False  # all ten blocks at once: no
    seq = mgr.admit("a", plan)
    assert mgr.reserve("a", 20) == 20 and len(seq.block_ids) == 5
    assert mgr.reserve("a", 40) == 24  # one block left in the pool
    mgr.commit("a", 24)  # releases blocks 0..3, so the rest fits
    assert mgr.reserve("a", 40) == 40 and seq.num_released_blocks == 4
    mgr.check_integrity()
    with pytest.raises(ValueError, match=r"reserve\('a'\): num_tokens must be an int in "
                                         r"\[0, 40\], got 41"):
        mgr.reserve("a", 41)
    with pytest.raises(ValueError, match="reserve: unknown seq_id 'b'"):
        mgr.reserve("b", 1)
    mgr.free_sequence("a")


def test_blocks_reserved_chunk_by_chunk_are_counted_as_allocated() -> None:
    # A cold 40-token prompt in chunks of 8: ten blocks, each counted once as it is
    # reserved (mutmut's generic mutants found the counters of a reserve unchecked).
    mgr = _manager()
    seq = _run(mgr, "a", _prompt(40))
    stats = mgr.stats()
    assert len(seq.block_ids) == 10
    assert (stats.alloc_total_blocks, stats.alloc_new_blocks) == (10, 10)
    mgr.free_sequence("a")


def test_a_warm_prompt_needs_only_its_window_however_much_was_evicted() -> None:
    prompt = _prompt(40)
    mgr = _cold_run_on_the_smallest_pool(prompt)
    assert mgr.stats().evicted_blocks == 5 and _hollow_tokens(mgr) == 20  # blocks 0..4
    assert mgr.probe_reuse(prompt) == 39
    assert mgr.probe_reuse(prompt[:32] + [1] * 10) == 32  # needs blocks 6, 7: cached
    assert mgr.probe_reuse(prompt[:20] + [1] * 10) == 0   # needs blocks 3, 4: evicted
    warm = _run(mgr, "warm", prompt)
    assert warm.num_cached_tokens == 39 and warm.num_released_blocks == 8
    mgr.free_sequence("warm")
    mgr.check_integrity()


def test_match_reuse_lists_only_the_blocks_the_window_holds() -> None:
    prompt = _prompt(40)
    mgr = _cold_run_on_the_smallest_pool(prompt)  # blocks 0..4 evicted: a hollow path
    match = mgr.match_reuse(prompt)
    # 39 tokens: 9 full blocks and 3 tokens of the last, whose window starts in block 8
    assert (match.num_tokens, match.num_full_blocks, match.num_skipped_blocks) == (39, 9, 8)
    assert match.partial == "claim" and len(match.block_ids) == 2  # block 8, then block 9
    assert mgr.plan_admission(prompt, first_chunk=CHUNK).reuse == match
    warm = mgr.admit("warm", mgr.plan_admission(prompt, first_chunk=CHUNK))
    assert warm.num_released_blocks == 8 and tuple(warm.block_ids[8:]) == match.block_ids
    mgr.free_sequence("warm")
    mgr.check_integrity()


def test_recomputed_blocks_fill_the_hollow_path() -> None:
    prompt = _prompt(40)
    mgr = _cold_run_on_the_smallest_pool(prompt)
    other = prompt[:20] + [1] * 4
    _run(mgr, "again", other)  # recomputes blocks 0..4 and commits them under their path
    assert _hollow_tokens(mgr) < 20
    mgr.free_sequence("again")
    mgr.check_integrity()
    assert mgr.probe_reuse(prompt[:20] + [2] * 4) == 20


def test_a_deduplicated_commit_switches_then_releases() -> None:
    mgr = _manager(blocks=32)
    prompt = _prompt(24)
    a = mgr.add_sequence("a", prompt)
    b = mgr.add_sequence("b", prompt)  # admitted before a committed: computes its own
    mgr.commit("a", 16)
    own = list(b.block_ids[:4])
    mgr.commit("b", 16)  # switches to a's blocks 0..3, gives its own back, releases 0, 1
    assert b.num_released_blocks == 2 and b.block_ids_version == 1
    assert list(b.block_ids[2:4]) == list(a.block_ids[2:4]) != own[2:4]
    assert set(own) <= set(mgr.state.pool.free)
    mgr.check_integrity()
    for sid in ("a", "b"):
        mgr.free_sequence(sid)
    mgr.check_integrity()
    assert mgr.state.pool.num_available == 32


def test_integrity_names_a_sequence_holding_what_its_window_released() -> None:
    mgr = _manager()
    mgr.add_sequence("a", _prompt(40))
    mgr.commit("a", 24)
    mgr.state.records["a"].num_released_blocks = 3  # as if the commit released one too few
    with pytest.raises(IntegrityError, match="3 blocks released, the window of position 24 "
                                             "releases 4"):
        mgr.check_integrity()
    mgr.state.records["a"].num_released_blocks = 4
    mgr.free_sequence("a")


def test_a_commit_beyond_the_reserved_blocks_is_refused_and_changes_nothing() -> None:
    """Admitted with a first chunk of 2 tokens (one block of 4), a commit of all 8 tokens
    used to release 3 positions and cache an 8-token edge holding 1 block; tokens without
    a block have no KV to commit."""
    mgr = _manager()
    seq = mgr.admit("a", mgr.plan_admission(_prompt(8), first_chunk=2))
    before = (list(seq.block_ids), seq.num_committed_tokens, mgr.state.tree.dump(), mgr.stats())
    with pytest.raises(ValueError, match=r"commit\('a', 8\): only 4 tokens have blocks"):
        mgr.commit("a", 8)
    assert (list(seq.block_ids), seq.num_committed_tokens, mgr.state.tree.dump(),
            mgr.stats()) == before
    mgr.commit("a", 4)
    mgr.check_integrity()
    mgr.free_sequence("a")

@pytest.mark.parametrize("seed", range(24))
def test_random_operations_on_small_pools_keep_every_invariant(seed: int) -> None:
    """Admissions with a first chunk, reserves, commits, appends and frees over tiny
    pools and alphabets, so releases, hollow nodes, switches and claims under pressure
    meet (seed 7 once found a pressure claim evicting blocks a window still held)."""
    rng = random.Random(seed)
    B, window, pool = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 5, 8]), rng.randint(3, 24)
    reuse = rng.random() < 0.8
    mgr = KvCacheManager(KvCacheConfig(
        tokens_per_block=B, max_num_blocks=pool, sliding_window=window,
        enable_block_reuse=reuse, enable_partial_reuse=rng.choice([None, False]) if reuse
        else None))
    seen = [_prompt(20, seed)]
    for step in range(150):
        live = sorted(mgr.sequences)
        op = rng.choice(["admit", "admit", "reserve", "commit", "commit", "append", "free"]
                        if live else ["admit"])
        if op == "admit":
            base = rng.choice(seen)
            tokens = base[:rng.randint(0, len(base))] + [rng.randint(1, 3)
                                                          for _ in range(rng.randint(1, 6))]
            plan = mgr.plan_admission(tokens, first_chunk=rng.choice([1, 2, 5, 9]))
            if plan.fits:
                seq = mgr.admit(step, plan)
                assert seq.num_cached_tokens == plan.num_cached_tokens
                seen.append(tokens)
                mgr.take_copy_ops()
            continue
        sid = rng.choice(live)
        seq = mgr.sequences[sid]
        covered = min(seq.num_tokens, len(seq.block_ids) * B)
        if op == "reserve":
            mgr.reserve(sid, rng.randint(seq.num_committed_tokens, seq.num_tokens))
        elif op == "commit":
            mgr.commit(sid, rng.randint(seq.num_committed_tokens, covered))
        elif op == "append" and covered == seq.num_tokens and mgr.state.pool.num_available:
            mgr.append_tokens(sid, [rng.randint(1, 3)])
        elif op == "free":
            seen.append(list(seq.tokens))
            mgr.free_sequence(sid)
        mgr.check_integrity()
    for sid in sorted(mgr.sequences):
        mgr.free_sequence(sid)
    mgr.check_integrity()
    assert mgr.leak_report() == []
