"""The reuse assertion framework: windows, bounds, failure tables, oracle comparison."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from harness.oracle import OracleConfig, predict_sequential, replay
from harness.reuse.adapters import KvcacheEngineAdapter
from harness.reuse.assertions import (
    Bounds,
    ReproContext,
    ReuseMismatch,
    canonical_name,
    diff_stats,
    expect_full_blocks_bounded,
    expect_matches_oracle,
    expect_reuse,
    predict_from_engine,
)
from harness.reuse.engine_protocol import EngineUnderTest
from harness.workloads import multi_turn_conversations, shared_system_prompt
from kvcache import Engine, KvCacheConfig, KvCacheManager, KvCacheStats

BEFORE = {"reusedBlocks": 10, "missedBlocks": 5, "maxNumBlocks": 64, "freeNumBlocks": 60,
          "allocTotalBlocks": 5}
AFTER = {"reused_blocks": 13, "missed_blocks": 7, "max_num_blocks": 64, "free_num_blocks": 50,
         "alloc_total_blocks": 9}


@pytest.mark.parametrize(("name", "canonical"), [
    ("reused_blocks", "reusedBlocks"), ("reusedBlocks", "reusedBlocks"),
    ("num_reused_blocks", "reusedBlocks"), ("numMissedBlocks", "missedBlocks"),
    ("kv_cache_hit_rate", "cacheHitRate"), ("num_total_allocated_blocks", "allocTotalBlocks"),
])
def test_canonical_names(name: str, canonical: str) -> None:
    assert canonical_name(name) == canonical


def test_window_diffs_counters_keeps_gauges_recomputes_hit_rate() -> None:
    # counters: 13-10, 7-5, 9-5; gauges from AFTER; hit rate 3 / (3 + 2) over the window
    assert diff_stats(BEFORE, AFTER) == {"reusedBlocks": 3, "missedBlocks": 2,
                                         "maxNumBlocks": 64, "freeNumBlocks": 50,
                                         "allocTotalBlocks": 4, "cacheHitRate": 0.6}


def test_window_from_kvcache_stats_objects() -> None:
    before = KvCacheStats(64, 60, 4, 16, reused_blocks=1, missed_blocks=3)
    after = KvCacheStats(64, 58, 6, 16, reused_blocks=4, missed_blocks=3)
    window = expect_reuse(before, after, exact={"reusedBlocks": 3, "missed_blocks": 0},
                          at_least={"usedNumBlocks": 6})
    assert (window["cacheHitRate"], window["freeNumBlocks"]) == (1.0, 58)


def test_before_none_means_since_start() -> None:
    assert expect_reuse(None, AFTER, exact={"reusedBlocks": 13})["cacheHitRate"] == 13 / 20


def test_failure_table_text() -> None:
    with pytest.raises(ReuseMismatch) as info:
        expect_reuse(
            BEFORE, AFTER, exact={"reusedBlocks": 4, "missedBlocks": 2},
            at_most={"allocTotalBlocks": 3},
            per_request={7: {"reusedBlocks": 2, "missed_blocks": 1},
                         8: {"reusedBlocks": Bounds(at_least=1)}},
            actual_requests={7: {"num_reused_blocks": 1, "num_missed_blocks": 1}},
            context=ReproContext("tests/scenarios/test_x.py::test_y[p16]", seed=3,
                                 config={"tokens_per_block": 16}),
            tree_dump=lambda: "scope None\n  [1, 2] tokens=2")
    assert str(info.value) == """\
reuse mismatch: 4 of 6 checks failed
  where      counter           expected  actual
  total      reusedBlocks      == 4      3        <-- mismatch
  total      missedBlocks      == 2      2
  total      allocTotalBlocks  <= 3      4        <-- mismatch
  total      cacheHitRate      -         0.6
  request 7  reusedBlocks      == 2      1        <-- mismatch
  request 7  missedBlocks      == 1      1
  request 8  reusedBlocks      >= 1      missing  <-- mismatch
reproduce: pytest 'tests/scenarios/test_x.py::test_y[p16]'  # seed=3 tokens_per_block=16
cache tree:
  scope None
    [1, 2] tokens=2"""
    assert isinstance(info.value, AssertionError)


@pytest.mark.parametrize(("kwargs", "ok"), [
    pytest.param({"at_least": {"reusedBlocks": 3}}, True, id="ge-edge"),
    pytest.param({"at_least": {"reusedBlocks": 4}}, False, id="ge-fail"),
    pytest.param({"at_most": {"missedBlocks": 2}}, True, id="le-edge"),
    pytest.param({"at_most": {"missedBlocks": 1}}, False, id="le-fail"),
    pytest.param({"at_least": {"reusedBlocks": 2}, "at_most": {"reusedBlocks": 3}}, True,
                 id="range"),
    pytest.param({"at_least": {"cacheHitRate": 0.7}}, False, id="rate"),
])
def test_bounds(kwargs: dict[str, Any], ok: bool) -> None:
    if ok:
        expect_reuse(BEFORE, AFTER, **kwargs)
    else:
        with pytest.raises(ReuseMismatch, match="1 of 1 checks failed"):
            expect_reuse(BEFORE, AFTER, **kwargs)


def test_range_is_shown_as_lo_hi() -> None:
    with pytest.raises(ReuseMismatch, match=r"reusedBlocks  4\.\.6      3       <-- mismatch"):
        expect_reuse(BEFORE, AFTER, at_least={"reusedBlocks": 4}, at_most={"reusedBlocks": 6})


@pytest.mark.parametrize(("kwargs", "message"), [
    pytest.param({"exact": {"reusedBlocks": 1}, "at_least": {"reused_blocks": 1}},
                 "both an exact value and at_least", id="exact-and-bound"),
    pytest.param({"exact": {"evictedBlocks": 0}}, r"no counter \['evictedBlocks'\]",
                 id="unknown-counter"),
    pytest.param({"per_request": {1: {"reusedBlocks": 1}}}, "need actual_requests",
                 id="no-actuals"),
])
def test_bad_expectations(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expect_reuse(BEFORE, AFTER, **kwargs)


def test_bad_stats() -> None:
    with pytest.raises(ValueError, match=r"after\['reusedBlocks'\] is 'x', not a number"):
        diff_stats(None, {"reusedBlocks": "x"})
    with pytest.raises(ValueError, match="repeats counter 'reusedBlocks'"):
        diff_stats(None, {"reusedBlocks": 1, "reused_blocks": 1})
    with pytest.raises(ValueError, match="Bounds needs"):
        Bounds()


@dataclass(frozen=True)
class Result:
    request_id: Hashable
    token_ids: Sequence[int]
    logits: Any
    num_cached_tokens: int
    kv_metrics: Mapping[str, int | float]


class CacheOnlyEngine:
    """A real `EngineUnderTest` over KvCacheManager with no model: it runs requests one
    at a time and "generates" token 7, committing prompt + all generated tokens but the
    last (whose KV a real engine never computes)."""

    def __init__(self, cfg: KvCacheConfig) -> None:
        self.mgr = KvCacheManager(cfg, record_events=True)
        self._next_id = 0

    @property
    def cache_config(self) -> KvCacheConfig:
        return self.mgr.state.config

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 scopes: Sequence[Any] | None = None) -> list[Result]:
        out = []
        for i, prompt in enumerate(prompts):
            sid, self._next_id = self._next_id, self._next_id + 1
            seq = self.mgr.add_sequence(sid, prompt, None if scopes is None else scopes[i])
            self.mgr.take_copy_ops()  # no KV tensors here: nothing to apply
            self.mgr.commit(sid, len(prompt))
            self.mgr.append_tokens(sid, [7] * max_new_tokens)
            self.mgr.commit(sid, len(prompt) + max_new_tokens - 1)
            out.append(Result(sid, [7] * max_new_tokens, None, seq.num_cached_tokens,
                              seq.metrics.as_dict()))
            self.mgr.free_sequence(sid)
        return out

    def kv_cache_stats(self) -> KvCacheStats:
        return self.mgr.stats()

    def admission_log(self) -> list[dict[str, Any]]:
        return [e.as_dict() for e in self.mgr.state.events or ()]


PROMPTS = shared_system_prompt(6, 10, 3, num_groups=2, vocab=50, seed=1)


def test_engine_matches_oracle_per_request_and_total() -> None:
    engine = CacheOnlyEngine(KvCacheConfig(tokens_per_block=4, max_num_blocks=256))
    assert isinstance(engine, EngineUnderTest)
    results = engine.generate(PROMPTS[:3], 2) + engine.generate(PROMPTS[3:], 2)
    prediction = predict_from_engine(engine)
    window = expect_matches_oracle(engine, prediction, results=results)
    assert window["reusedBlocks"] == prediction.totals.reused_blocks > 0
    # one request at a time: the log-driven prediction equals the sequential one
    cfg = OracleConfig.from_cache_config(engine.cache_config)
    assert predict_sequential(PROMPTS, results, None, cfg).admissions == prediction.admissions


def test_engine_vs_wrong_prediction_names_requests() -> None:
    engine = CacheOnlyEngine(KvCacheConfig(tokens_per_block=4, max_num_blocks=256))
    results = engine.generate(PROMPTS, 2)
    wrong = replay(engine.admission_log(), OracleConfig(4, enable_block_reuse=False))
    with pytest.raises(ReuseMismatch) as info:
        expect_matches_oracle(engine, wrong, results=results,
                              context=ReproContext("t.py::x"), tree_dump=engine.mgr.state.tree.dump)
    text = str(info.value)
    assert "  total      reusedBlocks         == 0      " in text
    assert "  request 2  numCachedTokens      == 0      " in text and "<-- mismatch" in text
    assert "reproduce: pytest t.py::x" in text and "cache tree:\n  scope None" in text
    assert "  (2 more requests matched every check)" in text  # the cold ones, 0 and 1
    assert "request 0" not in text



@dataclass(frozen=True)
class SeqIdResult:
    """A result that names its request by the cache's word for it."""

    seq_id: Hashable
    token_ids: Sequence[int]
    num_cached_tokens: int
    kv_metrics: Mapping[str, int | float]


def test_a_result_names_its_request_by_request_id_alone() -> None:
    # one spelling at the harness boundary: the checks read request_id, never seq_id
    engine = CacheOnlyEngine(KvCacheConfig(tokens_per_block=4, max_num_blocks=256))
    results = engine.generate(PROMPTS[:2], 2)
    prediction = predict_from_engine(engine)
    expect_matches_oracle(engine, prediction, results=results)
    spelled = [SeqIdResult(r.request_id, r.token_ids, r.num_cached_tokens, r.kv_metrics)
               for r in results]
    for check in (lambda: expect_matches_oracle(engine, prediction, results=spelled),
                  lambda: expect_full_blocks_bounded(engine, spelled)):
        with pytest.raises(AttributeError, match="request_id"):
            check()

def test_bounded_pool_stays_under_oracle() -> None:
    # 8 blocks for prompts of 4 blocks each: evictions; partial reuse off keeps the
    # oracle a strict upper bound (see harness.oracle.model's docstring)
    cfg = KvCacheConfig(tokens_per_block=4, max_num_blocks=8, enable_partial_reuse=False)
    engine = CacheOnlyEngine(cfg)
    results = engine.generate(PROMPTS + PROMPTS[::-1], 2)
    prediction = predict_from_engine(engine)
    window = expect_matches_oracle(engine, prediction, exact=False, results=results)
    assert window["reusedBlocks"] <= prediction.totals.reused_blocks
    assert engine.mgr.stats().evicted_blocks > 0


@pytest.mark.parametrize(("B", "chunk", "copy"), [
    pytest.param(4, 7, True, id="b4-chunk7-copy"), pytest.param(3, 3, False, id="b3-chunk3")])
def test_real_engine_multi_turn_matches_oracle(B: int, chunk: int, copy: bool) -> None:
    """kvcache's Engine (tiny model, CPU) through the protocol: batched, chunked prefill,
    each turn's prompt built from the tokens the previous turn really generated."""
    from kvcache import Engine

    cfg = KvCacheConfig(tokens_per_block=B, max_num_blocks=512, copy_on_partial_reuse=copy)
    engine = Engine("tiny", cfg, max_num_tokens=chunk)
    assert isinstance(engine, EngineUnderTest)
    assert OracleConfig.from_cache_config(engine.cache_config).copy_on_partial_reuse is copy
    convs = multi_turn_conversations(3, 3, 9, 3, 0, num_system_prompts=2, vocab=200, seed=2)
    answers: list[list[list[int]]] = [[] for _ in convs]
    results: list[Any] = []
    for turn in range(3):
        outs = engine.generate([c.prompt(turn, a) for c, a in zip(convs, answers, strict=True)],
                               3)
        for a, out in zip(answers, outs, strict=True):
            a.append(list(out.token_ids))
        results += outs
    prediction = predict_from_engine(engine)
    window = expect_matches_oracle(engine, prediction, results=results)
    assert window["fullReusedBlocks"] > 0


@pytest.mark.parametrize(("flags", "effective"), [
    pytest.param({}, (True, True, True), id="auto"),
    pytest.param({"enable_block_reuse": False}, (False, False, False), id="reuse-off"),
    pytest.param({"enable_partial_reuse": False}, (True, False, False), id="partial-off"),
    pytest.param({"copy_on_partial_reuse": False}, (True, True, False), id="copy-off"),
])
def test_every_reader_of_an_engine_config_agrees(flags: dict[str, bool],
                                                 effective: tuple[bool, bool, bool]) -> None:
    """The config object, the adapter's protocol mapping and the oracle's replay of the
    engine all resolve "auto" the same way (through OracleConfig.from_cache_config)."""
    engine = Engine("tiny", KvCacheConfig(tokens_per_block=4, max_num_blocks=32, **flags))
    expected = OracleConfig(4, *effective)
    assert OracleConfig.from_cache_config(engine.cache_config) == expected
    adapter = KvcacheEngineAdapter(engine)
    assert adapter.cache_config == {**expected.as_dict(), "max_num_blocks": 32,
                                    "host_cache_blocks": 0}
    assert OracleConfig.from_cache_config(adapter.cache_config) == expected
    bounded = OracleConfig.from_cache_config(adapter.cache_config, bounded=True)
    assert bounded == OracleConfig.from_cache_config(engine.cache_config, bounded=True)
    assert (bounded.max_num_blocks, bounded.host_cache_blocks) == (32, 0)
    # the oracle replaying the engine reads the same policy: a repeated 9-token prompt
    # reuses its first 8 tokens (the last is always recomputed), 2 blocks, with reuse on
    for _ in range(2):
        engine.generate([list(range(1, 10))], max_new_tokens=1)
    assert predict_from_engine(engine).totals.reused_blocks == (2 if effective[0] else 0)
    assert predict_from_engine(adapter).admissions == predict_from_engine(engine).admissions
