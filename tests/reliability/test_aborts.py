"""Aborts mid-prefill-chunk, mid-decode, while waiting and after a preemption.

An abort releases the request's blocks at once; what it committed (every computed chunk)
stays cached. Afterwards nothing leaks, the tree is intact, `probe_reuse` equals what the
oracle predicts from the cache's own event log, and a later request reuses exactly that
much while producing the cold run's outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.oracle import OracleConfig, ReuseOracle
from kvcache import Engine
from kvcache.engine import FinishReason, GenerationOutput, RequestFinishedError
from kvcache.model import Transformer
from tests.reliability.support import EngineSpec, assert_clean, assert_same_output, cold_outputs

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]  # 19


def oracle_of(engine: Engine) -> ReuseOracle:
    """An oracle fed every cache event so far."""
    oracle = ReuseOracle(OracleConfig.from_cache_config(engine.cache_config))
    oracle.replay(engine.admission_log())
    return oracle


def step_until(engine: Engine, done: Callable[[], bool], limit: int = 50
               ) -> list[GenerationOutput]:
    """Step until `done()` holds; returns the requests that finished meanwhile."""
    finished: list[GenerationOutput] = []
    for _ in range(limit):
        if done():
            return finished
        finished += engine.step()
    raise AssertionError(f"condition not reached in {limit} steps")


def drain(engine: Engine) -> list[GenerationOutput]:
    """Step until no request waits or runs; returns those that finished."""
    return step_until(engine, lambda: not engine.has_unfinished())


def check_reuse_after(engine: Engine, model: Transformer, prompt: list[int],
                      max_new_tokens: int, where: str) -> GenerationOutput:
    """Probe equals the oracle; a new request reuses that much and equals the cold run."""
    expected = oracle_of(engine).probe(prompt)
    assert engine.manager.probe_reuse(prompt) == expected, (
        f"{where}: probe_reuse {engine.manager.probe_reuse(prompt)}, oracle {expected}")
    out = engine.generate([prompt], max_new_tokens=max_new_tokens)[0]
    assert out.num_cached_tokens == expected, (
        f"{where}: the follow-up reused {out.num_cached_tokens} tokens, oracle {expected}")
    predicted = oracle_of(engine).prediction().requests[out.request_id]
    assert out.kv_metrics is not None
    assert out.kv_metrics.num_reused_blocks == predicted.reused_blocks, where
    assert_same_output(cold_outputs(model, [prompt], max_new_tokens)[0], out, where)
    assert_clean(engine.manager, where)
    return out


@pytest.mark.parametrize(("budget", "steps"), [
    pytest.param(3, 1, id="3tok"),        # inside the first block
    pytest.param(4, 2, id="8tok-aligned"),
    pytest.param(6, 1, id="6tok"),        # one full block and a partial one
    pytest.param(5, 3, id="15tok"),
    pytest.param(9, 2, id="18tok-last"),  # all but the last prompt token
])
def test_abort_mid_prefill_chunk(tiny_model: Transformer, budget: int, steps: int) -> None:
    engine = EngineSpec(4, 32, max_num_tokens=budget).build(tiny_model)
    rid = engine.add_request(PROMPT, 4)
    for _ in range(steps):
        engine.step()
    out = engine.abort(rid)
    assert out is not None and out.finish_reason is FinishReason.ABORTED
    assert out.token_ids == [], "nothing is sampled before the prompt is computed"
    assert_clean(engine.manager, "after the abort")
    computed = budget * steps
    # every computed token was committed, and the partial tail is cached on release
    assert engine.manager.probe_reuse(PROMPT) == computed
    check_reuse_after(engine, tiny_model, PROMPT, 3, f"abort after {computed} tokens")


@pytest.mark.parametrize("decode_steps", [1, 2, 4])
def test_abort_mid_decode(tiny_model: Transformer, decode_steps: int) -> None:
    prompt = PROMPT[:10]
    cold = cold_outputs(tiny_model, [prompt], 6)[0]
    engine = EngineSpec(4, 32).build(tiny_model)
    rid = engine.add_request(prompt, 6)
    for _ in range(decode_steps):  # the first step prefills and samples one token
        engine.step()
    out = engine.abort(rid)
    assert out is not None and out.finish_reason is FinishReason.ABORTED
    assert out.token_ids == cold.token_ids[:decode_steps]
    assert out.logits is not None and cold.logits is not None
    assert out.logits.shape[0] == decode_steps
    assert_clean(engine.manager, "after the abort")
    # the last sampled token was never computed: its KV is not cached
    assert engine.manager.probe_reuse(prompt + out.token_ids + [99]) == (
        len(prompt) + decode_steps - 1)
    turn = prompt + out.token_ids + [99, 98]  # the next turn of a chat
    check_reuse_after(engine, tiny_model, turn, 2, "next turn after the abort")
    check_reuse_after(engine, tiny_model, prompt, 2, "same prompt after the abort")


def test_abort_one_of_two_sharing_a_prefix(tiny_model: Transformer) -> None:
    a, b = PROMPT[:13], [*PROMPT[:9], 40, 41, 42, 43]
    cold = cold_outputs(tiny_model, [a, b], 5)
    engine = EngineSpec(4, 32, max_num_tokens=8).build(tiny_model)
    ra, rb = engine.add_request(a, 5), engine.add_request(b, 5)
    step_until(engine, lambda: engine.manager.sequences.keys() == {ra, rb}
               and engine.manager.sequences[rb].num_committed_tokens > 8)
    aborted = engine.abort(ra)
    assert aborted is not None and aborted.token_ids == cold[0].token_ids[:len(aborted.token_ids)]
    engine.manager.check_integrity()
    outs = drain(engine)
    assert [o.request_id for o in outs] == [rb]
    assert_same_output(cold[1], outs[0], "the request that was not aborted")
    assert_clean(engine.manager, "after both")
    check_reuse_after(engine, tiny_model, a, 2, "the aborted prompt again")


def test_abort_a_waiting_request_leaves_no_trace(tiny_model: Transformer) -> None:
    engine = EngineSpec(4, 32, max_batch_size=1).build(tiny_model)
    first = engine.add_request(PROMPT[:6], 2)
    second = engine.add_request(PROMPT[:9], 2)
    engine.step()  # one batch slot: `second` waits
    out = engine.abort(second)
    assert out is not None and out.token_ids == [] and out.num_cached_tokens == 0
    assert second not in {e["seq_id"] for e in engine.admission_log()}, "it was never admitted"
    done = engine.step() + engine.step()
    assert [o.request_id for o in done] == [first]
    assert_clean(engine.manager, "after the waiting request was aborted")


def test_abort_of_a_request_that_is_gone_says_so(tiny_model: Transformer) -> None:
    """Aborting twice, after the finish or an id never issued raises and changes nothing."""
    engine = EngineSpec(4, 32).build(tiny_model)
    finished = engine.generate([PROMPT[:5]], 2)[0].request_id
    aborted = engine.add_request(PROMPT[:7], 2)
    assert engine.abort(aborted).finish_reason is FinishReason.ABORTED
    before = (engine.manager.state.tree.dump(), engine.kv_cache_stats())
    for rid in (finished, aborted):
        with pytest.raises(RequestFinishedError, match=rf"abort\(#{rid}\): request #{rid} "
                                                       r"already finished or was aborted"):
            engine.abort(rid)
    for rid in (2, -1, True, "0"):
        with pytest.raises(ValueError, match=rf"abort\({rid!r}\): no such request; ids 0 to 1 "
                                             r"were issued") as info:
            engine.abort(rid)  # type: ignore[arg-type]
        assert not isinstance(info.value, RequestFinishedError)
    assert (engine.manager.state.tree.dump(), engine.kv_cache_stats()) == before
    with pytest.raises(ValueError, match=r"abort\(0\): no such request; no request was added "
                                         r"yet"):
        EngineSpec(4, 32).build(tiny_model).abort(0)
    assert_clean(engine.manager, "after the refused aborts")


def test_abort_a_preempted_request(tiny_model: Transformer) -> None:
    prompts = [PROMPT[:6], PROMPT[6:12], PROMPT[12:18]]
    cold = cold_outputs(tiny_model, prompts, 6)
    engine = EngineSpec(2, 9).build(tiny_model)  # 3 requests need 18 blocks at the end
    rids = [engine.add_request(p, 6) for p in prompts]
    finished = step_until(
        engine, lambda: any(r.num_preemptions for r in engine.scheduler.waiting))
    victim = next(r for r in engine.scheduler.waiting if r.num_preemptions)
    out = engine.abort(victim.request_id)
    assert out is not None and out.num_preemptions >= 1
    index = rids.index(victim.request_id)
    assert out.token_ids == cold[index].token_ids[:len(out.token_ids)]
    engine.manager.check_integrity()
    finished += drain(engine)
    for o in finished:
        assert_same_output(cold[rids.index(o.request_id)], o, "a request that survived")
    assert {o.request_id for o in finished} == set(rids) - {victim.request_id}
    assert_clean(engine.manager, "after the preempted request was aborted")
