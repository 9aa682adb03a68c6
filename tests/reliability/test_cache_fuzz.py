"""Cache fuzz: random operations on small pools under the provenance and capacity oracles.

A seed draws a block size, a pool of 3 to 10 blocks, the reuse flags and a walk of
operations over prompts that extend cut-off prefixes of earlier ones, from a tiny
alphabet, so partial matches, ties, copies and evictions are everyday events. The queued
copies are taken at random moments, so frees, evictions and other admissions come
between a copy's queueing and its application, in every order the API allows. Every
operation runs through `CheckedManager`: each reuse must read the reader's own KV (or KV
a queued copy writes first), usedNumBlocks must be what the live sequences need, a
refusal must be fair and change nothing, and every probe must equal the admission after
it; the integrity check runs after every operation. No reuse count is exact under
eviction, so none is compared. The test id is the seed; a failure names the seed's
settings and the command that replays it.

`test_cache_fuzz_quick` (100 seeds) is for pre-merge; `test_cache_fuzz_full` (2,000
other seeds, marked slow) for post-merge.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from harness.checked_manager import CheckedManager
from kvcache import KvCacheConfig, KVCacheManager, OutOfBlocksError, ReuseScope

QUICK_SEEDS = range(100)
FULL_SEEDS = range(100, 2100)
NUM_OPS = 60
SCOPES = [None, None, None, ReuseScope(salt=1)]
PRIORITIES = [35, 35, 35, 0, 100]


def config_of(seed: int) -> KvCacheConfig:
    """The cache settings of `seed` (pure function of the seed)."""
    rng = random.Random(seed)
    reuse = rng.random() < 0.9
    partial = reuse and rng.random() < 0.8
    copy = partial and rng.random() < 0.8
    return KvCacheConfig(tokens_per_block=rng.choice([1, 2, 3, 4]),
                         max_num_blocks=rng.randint(3, 10), enable_block_reuse=reuse,
                         enable_partial_reuse=partial, copy_on_partial_reuse=copy)


def walk(mgr: CheckedManager, rng: random.Random) -> None:
    """NUM_OPS random operations on `mgr`; raises what the checks raise."""
    seen: list[list[int]] = []
    next_id = 0
    for _ in range(NUM_OPS):
        live = list(mgr.sequences)
        roll = rng.random()
        if roll < 0.35 or not live:
            base = rng.choice(seen) if seen and rng.random() < 0.75 else []
            prompt = (base[:rng.randint(0, len(base))]
                      + [rng.randint(0, 3) for _ in range(rng.randint(1, 4))])[:12]
            seen.append(prompt)
            scope = rng.choice(SCOPES)
            probed = mgr.probe_reuse(prompt, scope)
            try:
                seq = mgr.add_sequence(next_id, prompt, scope, rng.choice(PRIORITIES))
            except OutOfBlocksError:
                continue  # CheckedManager checked the refusal was fair and changed nothing
            next_id += 1
            assert seq.num_cached_tokens == probed, (
                f"probe_reuse({prompt}) said {probed}, the admission reused "
                f"{seq.num_cached_tokens}")
        elif roll < 0.45:
            mgr.take_copy_ops()
        elif roll < 0.65:
            sid = rng.choice(live)
            seq = mgr.get_sequence(sid)
            mgr.commit(sid, rng.randint(seq.num_committed_tokens, seq.num_tokens))
        elif roll < 0.72:
            with contextlib.suppress(OutOfBlocksError):  # checked fair by CheckedManager
                mgr.append_tokens(rng.choice(live), [rng.randint(0, 3)])
        else:
            mgr.free_sequence(rng.choice(live))
        mgr.check_integrity()


def run_seed(seed: int, node_id: str) -> int:
    """Fuzz one seed; returns the operations checked. A failure names the seed."""
    cfg = config_of(seed)
    mgr = CheckedManager(KVCacheManager(cfg, record_events=True),
                         repro=f"replay: pytest '{node_id}'")
    try:
        walk(mgr, random.Random(seed))
        for sid in list(mgr.sequences):
            mgr.free_sequence(sid)
        mgr.take_copy_ops()
        assert mgr.leak_report() == [], mgr.leak_report()
    except AssertionError as exc:
        raise AssertionError(f"cache fuzz seed {seed} ({cfg}) failed after "
                             f"{mgr.num_operations} checked operations: {exc}") from exc
    return mgr.num_operations


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"s{s:04d}") for s in QUICK_SEEDS])
def test_cache_fuzz_quick(seed: int, request: pytest.FixtureRequest) -> None:
    run_seed(seed, request.node.nodeid)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"s{s:04d}") for s in FULL_SEEDS])
def test_cache_fuzz_full(seed: int, request: pytest.FixtureRequest) -> None:
    run_seed(seed, request.node.nodeid)


def test_the_seeds_cover_the_settings_that_matter() -> None:
    """Both slices reach every block size, copy and claim-only partial reuse, partial
    reuse off and block reuse off."""
    for seeds in (QUICK_SEEDS, FULL_SEEDS):
        cfgs = [config_of(s) for s in seeds]
        assert {c.tokens_per_block for c in cfgs} == {1, 2, 3, 4}
        assert {(c.block_reuse, c.partial_reuse, c.copy_on_partial) for c in cfgs} == {
            (True, True, True), (True, True, False), (True, False, False),
            (False, False, False)}
