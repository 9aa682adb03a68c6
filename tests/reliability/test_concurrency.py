"""Requests arrive from many threads while one thread runs the step loop.

`Engine` takes one fair lock in add_request, step, abort and generate. Producers here
add (and some abort) requests while the main thread steps; afterwards every request has
exactly one outcome, finished outputs equal the cold run's, aborted ones are a prefix of
it, and the cache is intact with nothing leaked. Interleavings vary from run to run; the
assertions hold for every one of them. Where a test needs one interleaving, it holds the
engine's lock and lets the other threads through one critical section (one step) at a
time: the lock is fair, so that order is deterministic and counted in steps. Threads are
joined with a timeout so a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import pytest

from harness.reuse.assertions import predict_from_engine
from kvcache import Engine, ReuseScope
from kvcache.engine import FinishReason, GenerationOutput, RequestFinishedError
from kvcache.engine.fair_lock import FairLock
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
                        try:
                            aborted: GenerationOutput | None = engine.abort(victim.rid)
                        except RequestFinishedError:  # it finished first: a race, expected
                            aborted = None
                        mine[mine.index(victim)] = victim._replace(aborted=aborted,
                                                                   abort_called=True)
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


# -- one interleaving, counted in steps ------------------------------------------------------

def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition`; fail (rather than hang) if it never holds."""
    deadline = time.monotonic() + JOIN_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def let_through(lock: FairLock, sections: int) -> None:
    """Holding `lock` with one other thread queued for it, let that thread through
    `sections` critical sections (an admission or one step each); returns holding it."""
    for _ in range(sections):
        wait_until(lambda: lock.num_waiting == 1, "the generate() thread queued")
        lock.release()
        lock.acquire()  # behind the queued thread: it runs one section first


def start_generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int
                   ) -> tuple[threading.Thread, dict[str, list[GenerationOutput] | BaseException]]:
    """generate() on a new thread; its result (or exception) lands in the dict's "result"."""
    box: dict[str, list[GenerationOutput] | BaseException] = {}

    def run() -> None:
        try:
            box["result"] = engine.generate(prompts, max_new_tokens)
        except BaseException as exc:  # reported by the test
            box["result"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def finish(thread: threading.Thread, box: dict[str, list[GenerationOutput] | BaseException]
           ) -> list[GenerationOutput]:
    thread.join(JOIN_SECONDS)
    assert not thread.is_alive(), "generate() never returned"
    result = box["result"]
    assert isinstance(result, list), f"generate() raised {result!r}"
    return result


def test_abort_of_requests_generate_waits_for(tiny_model: Transformer) -> None:
    """Another thread aborts a running and a waiting request of a generate() call: it
    returns every output, those two as aborted, and blames nothing on allocation."""
    prompts = [STEMS[0], STEMS[1], STEMS[2]]
    cold = cold_outputs(tiny_model, prompts, 12)
    engine = EngineSpec(4, 64, max_batch_size=2).build(tiny_model)  # the third waits
    lock = engine._lock
    with lock:
        thread, box = start_generate(engine, prompts, 12)
        let_through(lock, 1 + 3)  # the admission, then a prefill and two decode steps
        assert engine.num_steps == 3
        running, waiting = engine.abort(0), engine.abort(2)
    outs = finish(thread, box)
    assert [o.request_id for o in outs] == [0, 1, 2]
    assert outs[0] == running and outs[2] == waiting, "generate() returns what abort() did"
    assert running.finish_reason is FinishReason.ABORTED
    assert running.token_ids == cold[0].token_ids[:3]
    assert waiting.finish_reason is FinishReason.ABORTED and waiting.token_ids == []
    assert outs[1].finish_reason is FinishReason.LENGTH
    assert_same_output(cold[1], outs[1], "the request nobody aborted")
    assert_clean(engine.manager, "after the aborts")


@pytest.mark.parametrize("call", ["abort", "add_request"])
def test_a_waiting_call_gets_in_after_one_step(tiny_model: Transformer, call: str) -> None:
    """A call from another thread waits for the step in progress only, not for the work
    of a generate() call to drain: counted in steps, it completes one step after it
    queued, long before generate() finishes."""
    engine = EngineSpec(4, 64).build(tiny_model)
    lock = engine._lock
    done_at: list[int] = []
    added: list[int] = []
    aborted: list[GenerationOutput] = []

    def waiter() -> None:
        # The step count is read in the same critical section as the call (the lock is
        # reentrant): once the waiter releases it, the generate() thread may run another
        # step before this thread reads anything.
        with lock:
            if call == "abort":
                aborted.append(engine.abort(1))
            else:
                added.append(engine.add_request([40, 41, 42], 1))
            done_at.append(engine.num_steps)

    with lock:
        thread, box = start_generate(engine, [STEMS[0], STEMS[1]], 16)
        let_through(lock, 1 + 2)  # the admission and two steps
        wait_until(lambda: lock.num_waiting == 1, "the generate() thread queued")
        other = threading.Thread(target=waiter, daemon=True)
        other.start()
        wait_until(lambda: lock.num_waiting == 2, "the waiter queued behind it")
        queued_at = engine.num_steps
    other.join(JOIN_SECONDS)
    assert not other.is_alive(), "the waiting call never got the lock"
    outs = finish(thread, box)
    assert done_at == [queued_at + 1], "the waiter waited for more than the step in progress"
    assert done_at[0] < engine.num_steps, "the waiter got in only after generate() finished"
    if call == "abort":  # one token a step since the prefill, so the output counts too
        assert len(aborted[0].token_ids) == queued_at + 1, "aborted after another step"
    assert [o.finish_reason for o in outs] == [
        FinishReason.LENGTH, FinishReason.ABORTED if call == "abort" else FinishReason.LENGTH]
    if call == "add_request":  # finished by the generate() loop, handed to the next step()
        assert [o.request_id for o in engine.step()] == added
    assert_clean(engine.manager, f"after the {call}")


# -- reads from other threads ----------------------------------------------------------------

# Every public read of the engine, as a metrics thread would poll it: those that take the
# lock, then those that read one value without it.
LOCKED_READS: dict[str, Callable[[Engine], object]] = {
    "kv_cache_stats": Engine.kv_cache_stats,
    "admission_log": Engine.admission_log,
    "has_unfinished": Engine.has_unfinished,
}
READS: dict[str, Callable[[Engine], object]] = {
    **LOCKED_READS,
    "num_steps": lambda e: e.num_steps,
    "num_computed_tokens": lambda e: e.num_computed_tokens,
    "step_timer": lambda e: e.step_timer,
    "idle": lambda e: e.idle,
}


def test_every_read_is_safe_while_another_thread_generates(tiny_model: Transformer) -> None:
    """A poller reads everything, over and over, while a generate() thread runs waves
    over a host tier (offloads and onboards every wave): no read raises, and what they
    report only moves forward (counters, steps, the log, of which each read is a prefix of
    the last). The lock is fair, so the poller gets in between steps and sees the engine
    part-way through."""
    engine = EngineSpec(2, 12, max_num_tokens=16, host=24).build(tiny_model)
    waves = [[[*STEMS[(w + i) % 3], 50 + i] for i in range(3)] for w in range(6)]
    lock = engine._lock
    box: dict[str, BaseException | None] = {}

    def generate() -> None:
        try:
            for prompts in waves:
                engine.generate(prompts, max_new_tokens=3)
            box["result"] = None
        except BaseException as exc:  # reported below
            box["result"] = exc

    seen: dict[str, list[object]] = {name: [] for name in READS}
    errors: list[str] = []
    with lock:  # the poller is polling before the first wave is queued
        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        wait_until(lambda: lock.num_waiting == 1, "the generate() thread queued")
    while thread.is_alive():
        for name, read in READS.items():
            try:
                seen[name].append(read(engine))
            except Exception as exc:  # the bug this test is for: reported all at once
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
    thread.join(JOIN_SECONDS)
    assert box["result"] is None, f"generate() raised {box['result']!r}"
    assert not errors, "reads raised while another thread generated:\n" + "\n".join(errors)
    final = engine.num_steps
    steps = seen["num_steps"]
    assert steps == sorted(steps) and any(0 < s < final for s in steps), (
        f"the poller never saw the engine between its first and last step: {steps}")
    tokens = seen["num_computed_tokens"]
    assert tokens == sorted(tokens)
    log = engine.admission_log()
    assert all(got == log[:len(got)] for got in seen["admission_log"]), \
        "a read of the log is not a prefix of the final log"
    stats = seen["kv_cache_stats"]
    for field in ("alloc_total_blocks", "reused_blocks", "offloaded_blocks", "onboarded_blocks"):
        values = [getattr(s, field) for s in stats]
        assert values == sorted(values), f"{field} went backwards: {values}"
    last = engine.kv_cache_stats()
    assert last.offloaded_blocks > 0 and last.onboarded_blocks > 0, last
    assert_clean(engine.manager, "after the poller")


@pytest.mark.parametrize("read", list(LOCKED_READS))
def test_a_read_from_another_thread_waits_for_the_step_in_progress(
        tiny_model: Transformer, read: str) -> None:
    """Called from another thread while a step is inside the model, the read waits for
    the lock: it never looks at the cache or the queues half-way through a step."""
    engine = EngineSpec(4, 64, host=16).build(tiny_model)
    lock = engine._lock
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(LOCKED_READS[read](engine)),
                              daemon=True)
    waited: list[bool] = []

    def mid_step(module: object, args: object) -> None:
        if reader.ident is None:  # the first step only
            reader.start()
            wait_until(lambda: lock.num_waiting == 1 or not reader.is_alive(),
                       "the reader queued or finished")
            waited.append(reader.is_alive())

    handle = tiny_model.layers[1].register_forward_pre_hook(mid_step)
    try:
        engine.generate([STEMS[0], STEMS[2]], max_new_tokens=2)
    finally:
        handle.remove()
    reader.join(JOIN_SECONDS)
    assert waited == [True], f"{read}() ran in the middle of a step, without the lock"
    assert len(result) == 1, f"{read}() never returned"
