"""Requests arrive from many threads while one thread runs the step loop.

`Engine` takes one lock in add_request, step and abort. Producers here add (and some
abort) requests while the main thread steps; afterwards every request has exactly one
outcome, finished outputs equal the cold run's, aborted ones are a prefix of it, and the
cache is intact with nothing leaked. Interleavings vary from run to run; the assertions
hold for every one of them. Threads are joined with a timeout so a deadlock fails the
test instead of hanging it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import NamedTuple

import pytest

from harness.reuse.assertions import predict_from_engine
from kvcache import Engine, ReuseScope
from kvcache.engine import FinishReason, GenerationOutput
from kvcache.model import Transformer
from tests.reliability.support import (
    EngineSpec,
    assert_clean,
    assert_same_output,
    assert_same_outputs,
    cold_outputs,
)

STEMS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
JOIN_SECONDS = 60


def prompt_for(thread: int, i: int) -> list[int]:
    """Prompts that share stems across threads, so reuse happens between them."""
    stem = STEMS[(thread + i) % len(STEMS)]
    return [*stem[:3 + (thread * 7 + i) % len(stem)], 100 + thread, 200 + i]


class Submitted(NamedTuple):
    """One request a producer added, and what its abort returned (if it aborted)."""

    rid: int
    prompt: list[int]
    scope: ReuseScope | None
    aborted: GenerationOutput | None
    abort_called: bool


def run_concurrently(engine: Engine, threads: int, per_thread: int, max_new_tokens: int,
                     abort_every: int | None, check: Callable[[], None] | None = None
                     ) -> tuple[list[Submitted], list[GenerationOutput]]:
    """Producers add requests (aborting every `abort_every`-th right away or a little
    later) while this thread steps until they are done and nothing is left."""
    start = threading.Barrier(threads + 1)
    submitted: list[list[Submitted]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def produce(t: int) -> None:
        rng = random.Random(t)
        try:
            start.wait(JOIN_SECONDS)
            mine = submitted[t]
            for i in range(per_thread):
                p, scope = prompt_for(t, i), ReuseScope(salt=1) if i % 4 == 3 else None
                rid = engine.add_request(p, max_new_tokens, scope)
                mine.append(Submitted(rid, p, scope, None, False))
                if abort_every is not None and mine and rng.randrange(abort_every) == 0:
                    victim = mine[rng.randrange(len(mine))]
                    if not victim.abort_called:
                        mine[mine.index(victim)] = victim._replace(
                            aborted=engine.abort(victim.rid), abort_called=True)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=produce, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    start.wait(JOIN_SECONDS)
    outputs: list[GenerationOutput] = []
    for _ in range(20_000):
        busy = any(w.is_alive() for w in workers)
        if not busy and not engine.has_unfinished():
            break
        outputs += engine.step()
        if check is not None:
            check()
    for w in workers:
        w.join(JOIN_SECONDS)
        assert not w.is_alive(), "a producer thread did not finish: deadlock?"
    assert not errors, f"producers raised: {errors!r}"
    assert not engine.has_unfinished(), "the step loop gave up with requests left"
    return [s for mine in submitted for s in mine], outputs


def check_outcomes(model: Transformer, submitted: list[Submitted],
                   outputs: list[GenerationOutput], max_new_tokens: int) -> None:
    rids = [s.rid for s in submitted]
    assert len(set(rids)) == len(rids), "request ids were handed out twice"
    finished = {o.request_id: o for o in outputs}
    assert len(finished) == len(outputs), "a request finished twice"
    cold = cold_outputs(model, [s.prompt for s in submitted], max_new_tokens)
    for s, expected in zip(submitted, cold, strict=True):
        if s.aborted is not None:  # aborted before it finished: no output of its own
            assert s.rid not in finished, f"request {s.rid} was aborted and finished"
            assert s.aborted.finish_reason is FinishReason.ABORTED
            assert s.aborted.token_ids == expected.token_ids[:len(s.aborted.token_ids)]
            continue
        assert s.rid in finished, f"request {s.rid} never finished"
        assert_same_output(expected, finished[s.rid], f"request {s.rid} from a thread")
    assert set(finished) <= set(rids)


def test_add_request_from_many_threads_while_stepping(tiny_model: Transformer) -> None:
    engine = EngineSpec(4, 128, max_num_tokens=24, max_batch_size=6).build(tiny_model)
    submitted, outputs = run_concurrently(engine, threads=6, per_thread=4, max_new_tokens=3,
                                          abort_every=None,
                                          check=engine.manager.check_integrity)
    assert len(outputs) == 24
    check_outcomes(tiny_model, submitted, outputs, 3)
    assert_clean(engine.manager, "after the threads")
    predicted = predict_from_engine(engine)
    stats = engine.kv_cache_stats()
    assert stats.evicted_blocks == 0 and stats.reused_blocks > 0
    assert predicted.totals.reused_blocks == stats.reused_blocks


@pytest.mark.parametrize(("spec", "threads", "per_thread"), [
    pytest.param(EngineSpec(4, 128, max_num_tokens=16), 4, 6, id="roomy"),
    pytest.param(EngineSpec(2, 24, max_num_tokens=12), 6, 5, id="tight-preempting"),
    pytest.param(EngineSpec(1, 40, max_num_tokens=8, max_batch_size=3), 8, 3, id="b1-batch3"),
])
def test_bounded_stress_with_aborts(tiny_model: Transformer, spec: EngineSpec, threads: int,
                                    per_thread: int) -> None:
    engine = spec.build(tiny_model)
    submitted, outputs = run_concurrently(engine, threads, per_thread, max_new_tokens=4,
                                          abort_every=3)
    check_outcomes(tiny_model, submitted, outputs, 4)
    assert_clean(engine.manager, f"after the stress on {spec}")
    # the cache stays fully usable: a last request reuses what the threads committed
    p = prompt_for(0, 0)
    expected = engine.manager.probe_reuse(p)
    again = engine.generate([p], max_new_tokens=4)[0]
    assert again.num_cached_tokens == expected
    assert_same_output(cold_outputs(tiny_model, [p], 4)[0], again, "after the stress")
    assert_clean(engine.manager, "after the last request")


def test_generate_collects_only_its_own_requests(tiny_model: Transformer) -> None:
    engine = EngineSpec(4, 64, max_num_tokens=16).build(tiny_model)
    engine.add_request([1, 2, 3, 4, 5, 6], 1)  # another caller's request, already queued
    prompts = [list(range(40, 70)), list(range(70, 100))]
    outs = engine.generate(prompts, max_new_tokens=2)
    assert [o.prompt for o in outs] == [tuple(p) for p in prompts]
    assert_same_outputs(cold_outputs(tiny_model, prompts, 2), outs, "beside a stray request")
    while engine.has_unfinished():
        engine.step()
    assert_clean(engine.manager, "after generate")


def test_generate_from_many_threads_at_once(tiny_model: Transformer) -> None:
    """Each thread's generate() steps the shared engine and gets exactly its own outputs."""
    engine = EngineSpec(4, 128, max_num_tokens=16, max_batch_size=4).build(tiny_model)
    jobs = [[prompt_for(t, i) for i in range(1 + t % 3)] for t in range(6)]
    news = [2 + t % 4 for t in range(6)]
    start = threading.Barrier(len(jobs))
    results: dict[int, list[GenerationOutput] | BaseException] = {}

    def work(t: int) -> None:
        try:
            start.wait(JOIN_SECONDS)
            results[t] = engine.generate(jobs[t], max_new_tokens=news[t])
        except BaseException as exc:  # reported below
            results[t] = exc

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(len(jobs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(JOIN_SECONDS)
        assert not w.is_alive(), "a generate() call never returned"
    for t, prompts in enumerate(jobs):
        outs = results[t]
        assert isinstance(outs, list), f"thread {t}: generate raised {outs!r}"
        assert_same_outputs(cold_outputs(tiny_model, prompts, news[t]), outs, f"thread {t}")
    assert not engine.has_unfinished()
    assert_clean(engine.manager, "after the threads")


def test_generate_does_not_swallow_a_step_loop_callers_output(tiny_model: Transformer) -> None:
    engine = EngineSpec(4, 64).build(tiny_model)
    mine = engine.add_request([1, 2, 3], 1)  # caller A: add_request plus its own step loop
    engine.generate([[5, 6, 7, 8, 9]], 3)    # caller B finishes A's request on the way
    seen: list[GenerationOutput] = []
    for _ in range(10):
        seen += engine.step()
    assert [o.request_id for o in seen] == [mine], "caller A never got its output"
