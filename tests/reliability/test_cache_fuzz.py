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

The window seeds add a sliding window of 1 to 8 tokens: admissions plan a first chunk
(or all of the prompt), the walk reserves each later chunk's blocks and commits within
them (and now and then past them, which must be refused), so the capacity oracle checks
every release, reserve and hollow-path match against its restatement of the window rule.

`test_cache_fuzz_quick` (100 seeds) and `test_cache_fuzz_window_quick` (100) are for
pre-merge; `test_cache_fuzz_full` (2,000 other seeds) and `test_cache_fuzz_window_full`
(2,000 other window seeds), marked slow, for post-merge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest

from harness.oracle.checked_manager import CheckedManager
from kvcache import KvCacheConfig, KvCacheManager, OutOfBlocksError, ReuseScope

QUICK_SEEDS = range(100)
FULL_SEEDS = range(100, 2100)
WINDOW_QUICK_SEEDS = range(100)
WINDOW_FULL_SEEDS = range(100, 2100)
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


def window_config_of(seed: int) -> KvCacheConfig:
    """The settings of window seed `seed`: those of `config_of(seed)` plus a window of 1
    to 8 tokens (pure function of the seed)."""
    return dataclasses.replace(config_of(seed),
                               sliding_window=random.Random(-1 - seed).randint(1, 8))


def draw_prompt(rng: random.Random, seen: list[list[int]]) -> list[int]:
    """A prompt extending a cut-off earlier one (or none), remembered in `seen`."""
    base = rng.choice(seen) if seen and rng.random() < 0.75 else []
    prompt = (base[:rng.randint(0, len(base))]
              + [rng.randint(0, 3) for _ in range(rng.randint(1, 4))])[:12]
    seen.append(prompt)
    return prompt


def admit(mgr: CheckedManager, rng: random.Random, seq_id: int, prompt: list[int],
          chunked: bool) -> bool:
    """Admit `prompt` as `seq_id`, whole or (`chunked`) with a random first chunk;
    returns whether it was admitted. The probe with the same first chunk must equal the
    admission (a first chunk needs fewer blocks, so under pressure it may keep a partial
    match the whole prompt would forgo), and so must the plan."""
    scope = rng.choice(SCOPES)
    first = rng.randint(1, 6) if chunked else None
    probed = mgr.probe_reuse(prompt, scope, first_chunk=first)
    priority = rng.choice(PRIORITIES)
    if chunked:
        plan = mgr.plan_admission(prompt, scope, first_chunk=first)
        if not plan.fits:
            return False  # CheckedManager checked the plan's refusal was fair
        assert plan.num_cached_tokens == probed
        assert mgr.match_reuse(prompt, scope, first_chunk=first) == plan.reuse
        seq = mgr.admit(seq_id, plan, priority)
    else:
        try:
            seq = mgr.add_sequence(seq_id, prompt, scope, priority)
        except OutOfBlocksError:
            return False  # CheckedManager checked the refusal was fair and changed nothing
    assert seq.num_cached_tokens == probed, (
        f"probe_reuse({prompt}) said {probed}, the admission reused {seq.num_cached_tokens}")
    return True


def compute(mgr: CheckedManager, rng: random.Random, sid: int) -> None:
    """One step of `sid`'s prompt or decode: reserve the blocks of up to 6 more tokens
    (as many as the pool gives), commit within them; now and then commit past them, which
    must be refused and change nothing (CheckedManager checks that)."""
    seq = mgr.sequences[sid]
    done = seq.num_committed_tokens
    covered = mgr.reserve(sid, min(seq.num_tokens, done + rng.randint(1, 6)))
    beyond = len(seq.block_ids) * mgr.state.config.tokens_per_block + 1
    if beyond <= seq.num_tokens and rng.random() < 0.1:
        with pytest.raises(ValueError, match="reserve the rest"):
            mgr.commit(sid, beyond)
    mgr.commit(sid, rng.randint(done, covered))


def walk(mgr: CheckedManager, rng: random.Random) -> None:
    """NUM_OPS random operations on `mgr`; raises what the checks raise. Under a window
    half the admissions take a first chunk, and commits go through `compute`."""
    seen: list[list[int]] = []
    next_id = 0
    windowed = mgr.state.config.sliding_window is not None
    for _ in range(NUM_OPS):
        live = list(mgr.sequences)
        roll = rng.random()
        if roll < 0.35 or not live:
            chunked = windowed and rng.random() < 0.5
            if admit(mgr, rng, next_id, draw_prompt(rng, seen), chunked):
                next_id += 1
        elif roll < 0.45:
            mgr.take_copy_ops()
        elif roll < 0.65 and windowed:
            compute(mgr, rng, rng.choice(live))
        elif roll < 0.65:
            sid = rng.choice(live)
            seq = mgr.sequences[sid]
            mgr.commit(sid, rng.randint(seq.num_committed_tokens, seq.num_tokens))
        elif roll < 0.72:
            with contextlib.suppress(OutOfBlocksError):  # checked fair by CheckedManager
                mgr.append_tokens(rng.choice(live), [rng.randint(0, 3)])
        else:
            mgr.free_sequence(rng.choice(live))
        mgr.check_integrity()


def run_seed(seed: int, node_id: str, window: bool = False) -> int:
    """Fuzz one seed (of the window seeds with `window`); returns the operations checked.
    A failure names the seed."""
    cfg = window_config_of(seed) if window else config_of(seed)
    mgr = CheckedManager(KvCacheManager(cfg, record_events=True),
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


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"w{s:04d}") for s in WINDOW_QUICK_SEEDS])
def test_cache_fuzz_window_quick(seed: int, request: pytest.FixtureRequest) -> None:
    run_seed(seed, request.node.nodeid, window=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"w{s:04d}") for s in WINDOW_FULL_SEEDS])
def test_cache_fuzz_window_full(seed: int, request: pytest.FixtureRequest) -> None:
    run_seed(seed, request.node.nodeid, window=True)


def test_the_seeds_cover_the_settings_that_matter() -> None:
    """Both slices reach every block size, copy and claim-only partial reuse, partial
    reuse off and block reuse off."""
    for seeds in (QUICK_SEEDS, FULL_SEEDS):
        cfgs = [config_of(s) for s in seeds]
        assert {c.tokens_per_block for c in cfgs} == {1, 2, 3, 4}
        assert {(c.block_reuse, c.partial_reuse, c.copy_on_partial) for c in cfgs} == {
            (True, True, True), (True, True, False), (True, False, False),
            (False, False, False)}


def test_the_window_seeds_cover_the_settings_that_matter() -> None:
    """Both window slices reach every block size, windows inside one block and across
    several, and block reuse on and off."""
    for seeds in (WINDOW_QUICK_SEEDS, WINDOW_FULL_SEEDS):
        cfgs = [window_config_of(s) for s in seeds]
        assert {c.tokens_per_block for c in cfgs} == {1, 2, 3, 4}
        assert {c.block_reuse for c in cfgs} == {True, False}
        windows = {(c.sliding_window or 0) < c.tokens_per_block for c in cfgs}
        assert windows == {True, False}
