"""The reuse oracle against hand-computed cases (B = tokens per block, L = prompt length)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest

from harness.oracle import Event, OracleConfig, ReuseOracle, predict_sequential, replay
from harness.oracle.types import DEFAULT_PRIORITY, normalize_event
from kvcache import DEFAULT_PRIORITY as CACHE_DEFAULT

ON = OracleConfig(4)
NO_COPY = OracleConfig(4, copy_on_partial_reuse=False)
NO_PARTIAL = OracleConfig(4, enable_partial_reuse=False, copy_on_partial_reuse=False)
OFF = OracleConfig(4, enable_block_reuse=False)


def admit(sid: int, tokens: list[int], scope: Any = None) -> dict[str, Any]:
    return {"kind": "admit", "seq_id": sid, "tokens": tokens, "scope": scope}


def run(oracle: ReuseOracle, sid: int, prompt: list[int], generated: tuple[int, ...] = (),
        commit: int | None = None, free: bool = True, scope: Any = None) -> tuple[int, ...]:
    """Admit, append, commit (default: all tokens), maybe free; returns
    (full, partial, missed, reused tokens) of the admission."""
    r = oracle.apply(admit(sid, prompt, scope))
    assert r is not None
    oracle.apply({"kind": "append", "seq_id": sid, "tokens": generated})
    n = len(prompt) + len(generated) if commit is None else commit
    oracle.apply({"kind": "commit", "seq_id": sid, "num_tokens": n})
    if free:
        oracle.apply({"kind": "free", "seq_id": sid})
    return (r.full_reused_blocks, r.partial_reused_blocks, r.missed_blocks, r.reused_tokens)


def seq(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


# Cold run commits all L tokens and frees: floor(L/B) full blocks + a partial leaf of L % B.
# Warm run: limit L-1; n = floor((L-1)/B) full hits; the rest r = (L-1) % B is claimed
# from the leaf at position n (a partial leaf, or the last full block when L % B == 0).
@pytest.mark.parametrize(("B", "L", "partial", "warm"), [
    pytest.param(1, 5, True, (4, 0, 1, 4), id="b1-l5"),          # 5 full cached; n=4, r=0
    pytest.param(1, 1, True, (0, 0, 1, 0), id="b1-l1"),          # limit 0: nothing
    pytest.param(2, 5, True, (2, 0, 1, 4), id="b2-l5-mod1"),     # n=2, r=0, missed 3-2
    pytest.param(2, 6, True, (2, 1, 0, 5), id="b2-l6-mod0"),     # n=2, claim 1 of [5,6]
    pytest.param(4, 8, True, (1, 1, 0, 7), id="b4-l8-mod0"),     # n=1, claim 3 of [5..8]
    pytest.param(4, 8, False, (1, 0, 1, 4), id="b4-l8-mod0-nopartial"),  # L-1 cap: not 2
    pytest.param(4, 9, True, (2, 0, 1, 8), id="b4-l9-mod1"),     # n=2, r=0
    pytest.param(4, 10, True, (2, 1, 0, 9), id="b4-l10-mod2"),   # n=2, claim 1 of [9,10]
    pytest.param(4, 10, False, (2, 0, 1, 8), id="b4-l10-nopartial"),
    pytest.param(4, 3, True, (0, 1, 0, 2), id="b4-l3-short"),    # claim 2 of [1,2,3]
    pytest.param(4, 3, False, (0, 0, 1, 0), id="b4-l3-nopartial"),
    pytest.param(4, 1, True, (0, 0, 1, 0), id="b4-l1"),
    pytest.param(16, 32, True, (1, 1, 0, 31), id="b16-l32-mod0"),  # n=1, claim 15
    pytest.param(16, 33, True, (2, 0, 1, 32), id="b16-l33-mod1"),
    pytest.param(16, 40, True, (2, 1, 0, 39), id="b16-l40-mod8"),  # n=2, claim 7 of 8
    pytest.param(16, 1, True, (0, 0, 1, 0), id="b16-l1"),
])
def test_cold_then_warm(B: int, L: int, partial: bool, warm: tuple[int, ...]) -> None:
    cfg = OracleConfig(B, enable_partial_reuse=partial, copy_on_partial_reuse=partial)
    oracle = ReuseOracle(cfg)
    assert run(oracle, 0, seq(L)) == (0, 0, -(-L // B), 0)
    assert oracle.probe(seq(L)) == warm[3]
    assert run(oracle, 1, seq(L)) == warm


def test_shared_prefix_sequential_totals() -> None:
    # B=4; prompts = 8-token system [1..8] + 3 own tokens (L=11). Request 0 caches
    # [1..4], [5..8], [s,s,s]; request i>0: limit 10, n=2 full hits, r=2, the leaf
    # [s,s,s] of the previous request shares 0 tokens -> reuse 8 tokens, missed 1.
    prompts = [seq(8) + seq(3, 100 + 10 * i) for i in range(4)]
    pred = predict_sequential(prompts, None, None, ON)
    assert [a.reused_tokens for a in pred.admissions] == [0, 8, 8, 8]
    assert pred.totals.as_dict() == {
        "reusedBlocks": 6, "missedBlocks": 6, "fullReusedBlocks": 6,
        "partialReusedBlocks": 0, "reusedTokens": 24, "claimedBlocks": 0,
        "copiedBlocks": 0, "cacheHitRate": 0.5}
    assert pred.requests[3].as_dict()["missedBlocks"] == 1


def test_multi_turn_reuses_generated_blocks() -> None:
    # B=4. Turn 1: prompt [1..6], generates [50,51,52]; KV of 52 is never computed, so it
    # commits 6+2=8: blocks [1..4], [5,6,50,51]. Turn 2 = turn 1 + [50,51,52] + [60,61]
    # (L=11, limit 10): n=2 (the second block holds generated tokens), r=2, no tail
    # cached at position 2 -> 8 tokens, missed 3-2=1.
    t1 = seq(6)
    t2 = [*t1, 50, 51, 52, 60, 61]
    pred = predict_sequential([t1, t2], [[50, 51, 52], [70]], None, ON)
    r = pred.requests[1]
    assert (r.full_reused_blocks, r.partial_reused_blocks, r.missed_blocks,
            r.reused_tokens) == (2, 0, 1, 8)


def test_multi_turn_claims_generated_tail() -> None:
    # B=4. Turn 1: prompt [1..5], generates [50,51] -> commits 6 -> [1..4] + leaf [5,50].
    # Turn 2 = [1..5,50,51,60] (L=8, limit 7): n=1, r=3, [5,50] shares 2 -> claim.
    pred = predict_sequential([seq(5), [*seq(5), 50, 51, 60]], [[50, 51], [1]], None, ON)
    r = pred.requests[1]
    assert (r.full_reused_blocks, r.partial_reused_blocks, r.reused_tokens) == (1, 1, 6)
    assert r.partial_action == "claim"


def test_claimed_leaf_not_matchable_until_recommitted() -> None:
    # B=4, P=[1..10]: cold caches [1..4], [5..8], leaf [9,10].
    oracle = ReuseOracle(ON)
    P = seq(10)
    run(oracle, 0, P)
    assert run(oracle, 1, P, free=False, commit=9) == (2, 1, 0, 9)  # claims [9,10] -> [9]
    assert run(oracle, 2, P) == (2, 0, 1, 8)  # leaf gone while seq 1 lives; 2 caches [9,10]
    oracle.apply({"kind": "free", "seq_id": 1})  # seq 1 committed 9: tail [9] is covered
    assert run(oracle, 3, P) == (2, 1, 0, 9)  # [9,10] again, from seq 2's free


def test_claimed_full_block_leaves_the_cache() -> None:
    # B=4: [1..8] cached as 2 full blocks. Seq 1 (L=8, limit 7): n=1, claims 3 tokens of
    # [5..8], removing it. Seq 2 = [1..9] (limit 8) then hits [1..4] only: 4 tokens.
    oracle = ReuseOracle(ON)
    run(oracle, 0, seq(8))
    assert run(oracle, 1, seq(8), free=False, commit=7) == (1, 1, 0, 7)
    assert run(oracle, 2, seq(9), free=False) == (1, 0, 2, 4)


@pytest.mark.parametrize(("cfg", "expected", "action"), [
    pytest.param(ON, (1, 1, 0, 6), "copy", id="copy"),
    pytest.param(NO_COPY, (1, 0, 1, 4), None, id="nocopy"),
    pytest.param(NO_PARTIAL, (1, 0, 1, 4), None, id="nopartial"),
])
@pytest.mark.parametrize("holder", ["in-use", "non-leaf"])
def test_partial_source_in_use_or_interior(cfg: OracleConfig, expected: tuple[int, ...],
                                           action: str | None, holder: str) -> None:
    # B=4. The source [5..8] at position 1 is held by a live seq, or followed by [9..12].
    # The new prompt [1..6,77,78] (limit 7): n=1, wants [5,6,77]: shares 2 with [5..8].
    oracle = ReuseOracle(cfg)
    if holder == "in-use":
        run(oracle, 0, [*seq(8), 50], free=False)
    else:
        run(oracle, 0, seq(13))
    r = oracle.apply(admit(1, [*seq(6), 77, 78]))
    assert r is not None
    got = (r.full_reused_blocks, r.partial_reused_blocks, r.missed_blocks, r.reused_tokens)
    assert (got, r.partial_action) == (expected, action)
    assert oracle.probe([*seq(8), 50]) == 8  # a copy leaves the source cached


def _leaf_and_in_use(cfg: OracleConfig) -> ReuseOracle:
    # B=4. Seq 0 caches [1..4] and leaf [5,6]. Seq 1 (prompt [1..5], limit 4: no partial)
    # appends [6,7,8] and commits 8: [5..8] cached at position 1 and held by seq 1.
    oracle = ReuseOracle(cfg)
    run(oracle, 0, seq(6))
    run(oracle, 1, seq(5), (6, 7, 8), free=False)
    return oracle


@pytest.mark.parametrize("cfg", [ON, NO_COPY], ids=["copy", "nocopy"])
def test_tie_goes_to_unused_leaf(cfg: OracleConfig) -> None:
    # Wants [5,6,9]: leaf [5,6] and in-use [5..8] both share 2 -> the leaf is claimed.
    oracle = _leaf_and_in_use(cfg)
    r = oracle.apply(admit(2, [*seq(6), 9, 10]))
    assert r is not None and (r.reused_tokens, r.partial_action) == (6, "claim")
    # Leaf gone: only the in-use block remains (copy: 2 tokens; no copy: nothing).
    assert oracle.probe([*seq(6), 9, 10]) == (6 if cfg.copy_on_partial_reuse else 4)


@pytest.mark.parametrize(("cfg", "tokens", "action"), [
    pytest.param(ON, 7, "copy", id="copy"), pytest.param(NO_COPY, 6, "claim", id="nocopy")])
def test_longer_in_use_match_wins_only_with_copy(cfg: OracleConfig, tokens: int,
                                                 action: str) -> None:
    # Wants [5,6,7,9] (prompt [1..7,9,10], limit 8): in-use [5..8] shares 3, leaf [5,6] 2.
    oracle = _leaf_and_in_use(cfg)
    r = oracle.apply(admit(2, [*seq(7), 9, 10]))
    assert r is not None and (r.reused_tokens, r.partial_action) == (tokens, action)


def test_tie_between_unused_leaves_claims_the_newest() -> None:
    # B=4. Leaves [5,6] (older) and [5,7] (newer) after [1..4], made without partial
    # matches (prompts of 5 tokens, limit 4). Wanting [5,9] shares 1 with both: the newer
    # is claimed, so [5,6] still gives 2 tokens afterwards.
    oracle = ReuseOracle(ON)
    run(oracle, 0, seq(5), (6,))
    run(oracle, 1, seq(5), (7,))
    r = oracle.apply(admit(2, [*seq(5), 9, 10]))
    assert r is not None and r.reused_tokens == 5
    assert oracle.probe([*seq(6), 0]) == 6
    assert oracle.probe([*seq(5), 7, 0]) == 5


def test_tie_between_unused_leaves_claims_the_one_that_loses_least() -> None:
    # B=4. Leaves [1] (older) and [1, 0, 1] (newer), both from prompts admitted before
    # either was cached. Wanting [1, 7] shares 1 token with both: claiming [1] takes 1
    # cached token out, claiming [1, 0, 1] would take 3. [1] goes; [1, 0, 1] still gives 2.
    oracle = ReuseOracle(ON)
    for sid, prompt in ((0, [1, 0, 1]), (1, [1])):
        oracle.apply(admit(sid, prompt))
        oracle.apply({"kind": "commit", "seq_id": sid, "num_tokens": len(prompt)})
    oracle.apply({"kind": "free", "seq_id": 1})
    oracle.apply({"kind": "free", "seq_id": 0})
    r = oracle.apply(admit(2, [1, 7]))
    assert r is not None and (r.reused_tokens, r.partial_action) == (1, "claim")
    assert oracle.probe([1, 0, 1]) == 2


def test_commit_deduplicates_and_holds_the_cached_block() -> None:
    # B=4. Seqs 0 and 1 admit [1..8] cold and both commit 8: seq 1's blocks dedup onto
    # seq 0's and seq 1 holds them. After seq 0 is freed, [5..8] is still in use (by 1):
    # a partial match on it is a copy, not a claim (a private copy would leave a leaf).
    oracle = ReuseOracle(ON)
    for sid in (0, 1):
        oracle.apply(admit(sid, seq(8)))
    for sid in (0, 1):
        oracle.apply({"kind": "commit", "seq_id": sid, "num_tokens": 8})
    oracle.apply({"kind": "free", "seq_id": 0})
    assert run(oracle, 2, [*seq(6), 77, 78]) == (1, 1, 0, 6)
    assert oracle.prediction().admissions[-1].partial_action == "copy"


def test_free_deduplicates_partial_tails() -> None:
    # B=4, [1..8] cached. Seqs 0 and 1 admit [1..8,30] (2 full hits each), commit 9 and
    # are freed: tail [30] is cached once. One claim takes it; the next finds none.
    oracle = ReuseOracle(ON)
    run(oracle, 9, seq(8))
    for sid in (0, 1):
        oracle.apply(admit(sid, [*seq(8), 30]))
        oracle.apply({"kind": "commit", "seq_id": sid, "num_tokens": 9})
    for sid in (0, 1):
        oracle.apply({"kind": "free", "seq_id": sid})
    assert run(oracle, 2, [*seq(8), 30, 31], free=False) == (2, 1, 0, 9)
    assert run(oracle, 3, [*seq(8), 30, 31], free=False) == (2, 0, 1, 8)


@dataclass(frozen=True)
class Scope:
    """A value object shaped like kvcache.ReuseScope (the oracle reads it by attributes)."""

    salt: int | None = None
    lora_id: int | None = None


@pytest.mark.parametrize(("scope", "reused"), [
    pytest.param(None, 8, id="none"),
    pytest.param((None, None), 8, id="tuple-none"),
    pytest.param(Scope(), 8, id="empty-scope"),
    pytest.param((0, None), 0, id="salt0"),
    pytest.param(Scope(lora_id=1), 0, id="lora1"),
])
def test_scopes(scope: Any, reused: int) -> None:
    # B=4: [1..9] cached under scope None (2 full + leaf [9]); same prompt, limit 8.
    oracle = ReuseOracle(ON)
    run(oracle, 0, seq(9))
    assert oracle.probe(seq(9), scope) == reused
    assert run(oracle, 1, seq(9), scope=scope)[3] == reused


def test_salt_zero_shares_within_its_scope() -> None:
    oracle = ReuseOracle(ON)
    run(oracle, 0, seq(9), scope=(0, None))
    assert oracle.probe(seq(9), Scope(salt=0)) == 8
    assert oracle.probe(seq(9)) == 0


def test_reuse_off_misses_everything() -> None:
    pred = predict_sequential([seq(9)] * 3, None, None, OFF)
    assert [a.missed_blocks for a in pred.admissions] == [3, 3, 3]
    assert pred.totals.reused_blocks == 0 and pred.totals.cache_hit_rate == 0.0


def test_probe_changes_nothing() -> None:
    # B=4: a claimable leaf [9,10]; probing twice must not claim it.
    oracle = ReuseOracle(ON)
    run(oracle, 0, seq(10))
    assert [oracle.probe(seq(10)) for _ in range(2)] == [9, 9]
    assert run(oracle, 1, seq(10))[3] == 9
    assert oracle.prediction().totals.reused_blocks == 3


def test_replay_accepts_event_objects_and_mappings() -> None:
    @dataclass(frozen=True)
    class Ev:
        kind: str
        seq_id: int
        tokens: tuple[int, ...] = ()
        num_tokens: int = 0
        scope: Any = None

    events = [Ev("admit", 7, tuple(seq(5))), Ev("commit", 7, num_tokens=5),
              {"kind": "free", "seq_id": 7}, admit(8, seq(5)),
              {"kind": "copy", "seq_id": 8, "num_tokens": 2, "block_ids": [0, 3]}]
    pred = replay(events, ON)
    assert pred.requests[8].reused_tokens == 4 and 7 in pred.requests
    # seq 7 again (a preempted request recomputed): requests keeps its first admission
    again = replay([*events, {"kind": "free", "seq_id": 8}, admit(7, seq(5))], ON)
    assert again.requests[7].reused_tokens == 0
    assert [a.reused_tokens for a in again.admissions] == [0, 4, 4]


@pytest.mark.parametrize(("events", "message"), [
    pytest.param([admit(1, [1]), admit(1, [2])], "already live", id="dup-admit"),
    pytest.param([{"kind": "free", "seq_id": 3}], "not live", id="unknown"),
    pytest.param([admit(1, [1, 2]), {"kind": "commit", "seq_id": 1, "num_tokens": 3}],
                 r"\[0, 2\]", id="commit-past-end"),
    pytest.param([{"kind": "evict", "seq_id": 1}], "kind must be one of", id="kind"),
    pytest.param([admit(1, [])], "prompt is empty", id="empty"),
    pytest.param([admit(1, [1, -2])], "token -2", id="negative-token"),
    pytest.param([{**admit(1, [1]), "priority": 101}], r"priority must be an int in \[0, 100\], "
                 "got 101", id="priority-high"),
    pytest.param([{**admit(1, [1]), "priority": True}], "priority .* got True",
                 id="priority-bool"),
    pytest.param([{**admit(1, [1]), "priority": "80"}], "priority .* got '80'",
                 id="priority-str"),
])
def test_bad_events(events: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replay(events, ON)


def test_an_admit_without_a_priority_has_the_default_one() -> None:
    """Logs recorded before admissions carried a priority replay as they always did, at
    the cache's default; only an admission has one."""
    assert normalize_event(admit(1, [1])).priority == DEFAULT_PRIORITY == CACHE_DEFAULT
    assert normalize_event({**admit(1, [1]), "priority": None}).priority == DEFAULT_PRIORITY
    assert normalize_event({**admit(1, [1]), "priority": 0}).priority == 0
    assert normalize_event({"kind": "free", "seq_id": 1, "priority": 80}).priority is None


def test_commit_cannot_go_backwards() -> None:
    oracle = ReuseOracle(ON)
    run(oracle, 0, seq(9))
    oracle.apply(admit(1, seq(9)))  # reuses 8 tokens: its KV counts as committed
    with pytest.raises(ValueError, match=r"commit of 5 tokens for seq_id 1: must lie in \[8, 9\]"):
        oracle.apply({"kind": "commit", "seq_id": 1, "num_tokens": 5})


@pytest.mark.parametrize(("kwargs", "message"), [
    pytest.param({"tokens_per_block": 0}, "tokens_per_block", id="b0"),
    pytest.param({"tokens_per_block": 4, "reuse_alignment_blocks": 0}, "reuse_alignment_blocks",
                 id="align0"),
    pytest.param({"tokens_per_block": 4, "enable_block_reuse": None}, "True or False",
                 id="auto"),
    pytest.param({"tokens_per_block": 4, "sliding_window": 0}, "sliding_window", id="window0"),
])
def test_config_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OracleConfig(**kwargs)


def test_config_from_engine_mapping() -> None:
    cfg = OracleConfig.from_cache_config({"tokens_per_block": 8, "enable_block_reuse": True,
                                          "enable_partial_reuse": False,
                                          "copy_on_partial_reuse": False, "max_num_blocks": 9})
    assert cfg == OracleConfig(8, True, False, False)
    assert cfg.as_dict() == {"tokens_per_block": 8, "enable_block_reuse": True,
                             "enable_partial_reuse": False, "copy_on_partial_reuse": False,
                             "reuse_alignment_blocks": 1, "sliding_window": None}
    assert OracleConfig.from_cache_config(cfg.as_dict()) == cfg
    hybrid = OracleConfig.from_cache_config({**cfg.as_dict(), "reuse_alignment_blocks": 3})
    assert hybrid.reuse_alignment_blocks == 3
    windowed = OracleConfig.from_cache_config({**cfg.as_dict(), "sliding_window": 32})
    assert windowed.sliding_window == 32
    with pytest.raises(ValueError, match=r"enable_partial_reuse.*effective"):
        OracleConfig.from_cache_config({"tokens_per_block": 8, "enable_partial_reuse": None})


class _Resolved:
    """A config object read by shape: fields that may say None, resolved properties."""

    def __init__(self, tokens_per_block: object, block_reuse: object = True) -> None:
        self.tokens_per_block = tokens_per_block
        self.block_reuse = block_reuse
        self.partial_reuse = self.copy_on_partial = False


@pytest.mark.parametrize(("config", "message"), [
    pytest.param({"enable_block_reuse": True}, "engine.cache_config has no 'tokens_per_block' "
                 "(keys: ['enable_block_reuse'])", id="mapping-no-block-size"),
    pytest.param({"tokens_per_block": 0}, "engine.cache_config: OracleConfig.tokens_per_block "
                 "must be an int >= 1, got 0", id="mapping-block-size-0"),
    pytest.param({"tokens_per_block": 4, "copy_on_partial_reuse": "auto"},
                 "engine.cache_config['copy_on_partial_reuse'] must be the effective "
                 "True/False, got 'auto'", id="mapping-auto"),
    pytest.param(_Resolved(4, block_reuse=None), "engine.cache_config.block_reuse must be the "
                 "effective True/False, got None", id="object-unresolved"),
    pytest.param(_Resolved(True), "engine.cache_config: OracleConfig.tokens_per_block must be "
                 "an int >= 1, got True", id="object-bool-block-size"),
    pytest.param(object(), "expected a mapping or an object with tokens_per_block, "
                 "block_reuse, partial_reuse, copy_on_partial", id="neither"),
])
def test_config_from_bad_engine_configs_names_where(config: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        OracleConfig.from_cache_config(config, "engine.cache_config")


def test_alignment_cuts_matches_back_to_snapshot_blocks() -> None:
    oracle = ReuseOracle(OracleConfig(2, enable_partial_reuse=False,
                                      copy_on_partial_reuse=False, reuse_alignment_blocks=3))
    oracle.apply(Event("admit", "a", tuple(range(1, 16))))
    oracle.apply(Event("commit", "a", num_tokens=15))
    oracle.apply(Event("free", "a"))
    # 7 full blocks cached; a prompt sharing 14 tokens (L-1 cap) may use 6 of them
    assert oracle.probe(range(1, 16)) == 12
    assert oracle.probe([*range(1, 10), 50]) == 6  # 4 shared blocks -> 3
    assert oracle.probe([1, 2, 3, 4, 50]) == 0  # 2 shared blocks -> none


def test_a_window_releases_what_no_later_token_sees() -> None:
    """Window 6, blocks of 4: committing 16 tokens releases blocks 0 and 1 (position 16
    sees 11..16); the sequence keeps using blocks 2 and 3, and frees only those."""
    oracle = ReuseOracle(OracleConfig(4, sliding_window=6))
    oracle.apply(Event("admit", 0, tuple(range(1, 21))))
    oracle.apply(Event("commit", 0, (), 16))
    in_use = [k for k, n in oracle._users.items() if n]
    assert sorted(len(k[1]) for k in in_use) == [12, 16]
    oracle.apply(Event("free", 0))
    assert not oracle._users
    warm = oracle.apply(Event("admit", 1, tuple(range(1, 21))))
    assert warm is not None and warm.reused_tokens == 16
