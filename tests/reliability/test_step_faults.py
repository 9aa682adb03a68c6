"""A step is all or nothing, wherever it is interrupted: faults injected at every phase.

A CUDA out-of-memory error or an interrupt can strike anywhere inside a step. The engine's
rule (Engine._step, kvcache/engine/engine.py; docs/design.md, "A step is all or
nothing"): up to and including sampling a step that raises did not happen (the ops not
applied stay queued, the batch is recounted, every request keeps its recurrent state,
tokens and counts, the next step runs the same work); an admission whose batch join fails
is given back; once the step sampled it happened, and a postprocess that raises part-way
is completed, from where it stopped, by the engine's next call. A `generate()` that
raises aborts what it added.

The faults go in through the engine's own seam, `Engine.step_fault`
(kvcache/engine/step_fault.py): a `FaultPlan` numbers the calls of every phase and
raises at the points it was given, once each, a RuntimeError (as CUDA out of memory is)
or an `Interrupt` (like KeyboardInterrupt, not an Exception). The suite names phases,
never the engine's methods, so it survives their renames.

Each case runs a workload, lets the caller recover, and checks that the outputs equal a
cold run's, that nothing leaked, that the provenance oracle finds every read of the
reader's own KV, and (step loop) that the recovered run did exactly the clean run's work:
the same cache log, steps and computed tokens. The recoveries:
- steps: a step loop that steps again;
- generate: a new `generate()` for the wave that failed (the failed call aborted it);
- abort: a step loop that aborts every request of the wave not finished, whose first
  abort fails too (a second fault, at the abort phase: the caller aborts again), then
  runs them again.

The workloads: each of tiny, hybrid-tiny, tiny-swa and tiny-mixed-swa with shared
prefixes, partial hits (copies on tiny), recurrent snapshots (hybrid), window releases,
and a wave that preempts; the same over the BLHNC layout; and over a host tier (offloads
and onboards in one queue). The quick cases (pre-merge) pick one point of every phase and
fault kind on tiny and a few elsewhere; the wide ones (post-merge) try the first, middle
and last call of every phase (every call of copies, joins and preemptions) on every
workload, with every recovery. Three tests reproduce the findings that made the seam (issue 31).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import pytest

from kvcache import Engine
from kvcache.engine import STEP_PHASES, GenerationOutput, RequestFinishedError
from kvcache.model import Transformer, get_preset
from tests.reliability.support import (
    EngineSpec,
    assert_clean,
    assert_provenance,
    assert_same_outputs,
    cold_outputs,
)


class InjectedFault(RuntimeError):
    """A transient failure, as CUDA out of memory is (a RuntimeError)."""


class Interrupt(BaseException):
    """An interrupt: like KeyboardInterrupt, not an Exception."""


FAULTS = (InjectedFault, Interrupt)


class Point(NamedTuple):
    """Where a fault strikes: the `at`-th call (from 0) of `phase`, raising `error`."""

    phase: str
    at: int
    error: type[BaseException] = InjectedFault

    def __str__(self) -> str:
        return f"{self.error.__name__} at {self.phase} call {self.at}"


class FaultPlan:
    """The seam's hook (`Engine.step_fault`): numbers the calls of every phase (`calls`)
    and raises at each of `points`, once (`fired`). A phase the seam does not document
    fails the test (an AssertionError is no fault the recoveries catch)."""

    def __init__(self, *points: Point) -> None:
        self.points = points
        self.calls: Counter[str] = Counter()
        self.fired: set[Point] = set()

    def __call__(self, phase: str) -> None:
        assert phase in STEP_PHASES, f"the seam called an undocumented phase {phase!r}"
        n = self.calls[phase]
        self.calls[phase] += 1
        for point in self.points:
            if point.phase == phase and point.at == n:
                self.fired.add(point)
                raise point.error(f"injected fault: {point}")


# -- workloads --------------------------------------------------------------------------------

P = list(range(1, 50))  # a stem the prompts share
Q = list(range(100, 190))  # prompts that share nothing


@dataclass(frozen=True)
class Work:
    """Waves of prompts on `preset`; each wave runs to completion before the next."""

    preset: str
    spec: EngineSpec
    waves: tuple[tuple[tuple[int, ...], ...], ...]
    max_new_tokens: int = 4

    @property
    def prompts(self) -> list[list[int]]:
        return [list(p) for wave in self.waves for p in wave]


def wave(*prompts: list[int]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in prompts)


# five prompts of two blocks each on a short pool: an append finds no block, and preempts
PRESSURE = wave(*[Q[i:i + 8] for i in range(0, 90, 20)])
WAVES = {
    # shared prefixes, partial hits copied (BlockCopy), prefills chunked
    "tiny": (wave(P[:9], P[:10], [*P[:6], 40, 41, 42]),
             wave(P[:11], [*P[:6], 40, 41, 50]), PRESSURE),
    # recurrent state per request, snapshots at block ends, reuse aligned to them
    "hybrid-tiny": (wave(P[:9], [*P[:8], 60, 61]), wave(P[:13], [*P[:8], 60, 62]), PRESSURE),
    # a 32-token window: the requests release blocks no later token sees (tiny-swa), or
    # keep them for the full-attention layers (tiny-mixed-swa); a partial hit copied
    "tiny-swa": (wave(P[:40], [*P[:38], 70, 71, 72]), wave(P[:44]), PRESSURE),
}
WAVES["tiny-mixed-swa"] = WAVES["tiny-swa"]
SPECS = {"tiny": EngineSpec(4, 7, max_num_tokens=8),
         "hybrid-tiny": EngineSpec(4, 7, max_num_tokens=8),
         "tiny-swa": EngineSpec(4, 13, max_num_tokens=16),
         "tiny-mixed-swa": EngineSpec(4, 13, max_num_tokens=16)}
# a device pool of 10 blocks over a host tier: evictions offload, hits onboard, and one
# step's batch interleaves offloads and onboards into the blocks they freed
HOST_SPEC = EngineSpec(4, 10, max_num_tokens=16, max_batch_size=2, host=24)
HOST_WAVES = (wave(P[:16], P[20:30]), wave(P[30:46]), wave(P[:17], P[20:31]), wave(P[30:47]))
VARIANTS = ("plain", "blhnc", "host")


def work_of(preset: str, variant: str) -> Work:
    """The workload of `preset` in `variant`: plain, over the BLHNC layout, or over a
    host tier."""
    if variant == "host":
        return Work(preset, HOST_SPEC, HOST_WAVES)
    spec = SPECS[preset]
    return Work(preset, replace(spec, layout="BLHNC") if variant == "blhnc" else spec,
                WAVES[preset])


WORKS = {f"{preset}-{variant}": work_of(preset, variant)
         for preset in SPECS for variant in VARIANTS}


@pytest.fixture(scope="session")
def models() -> Callable[[str], Transformer]:
    """The model of a preset (seed 0), built once for the run; engines share them."""
    built: dict[str, Transformer] = {}

    def get(preset: str) -> Transformer:
        if preset not in built:
            built[preset] = Transformer(get_preset(preset), seed=0)
        return built[preset]

    return get


# -- one run ---------------------------------------------------------------------------------

Recovery = Literal["steps", "generate", "abort"]
RECOVERIES: tuple[Recovery, ...] = ("steps", "generate", "abort")


class Run(NamedTuple):
    """A workload's engine, its outputs (in prompt order) and the plan it ran under
    (its `calls`, in a clean run, number the points there are)."""

    engine: Engine
    outputs: list[GenerationOutput]
    plan: FaultPlan


def run(model: Transformer, work: Work, plan: FaultPlan, recovery: Recovery) -> Run:
    """`work` under `plan`; the caller recovers from a fault as `recovery` says."""
    engine = work.spec.build(model)
    engine.step_fault = plan
    outputs: list[GenerationOutput] = []
    for prompts in work.waves:
        if recovery == "generate":
            outputs += run_generate(engine, prompts, work)
        else:
            outputs += run_steps(engine, prompts, work, abort=recovery == "abort")
    return Run(engine, outputs, plan)


def run_steps(engine: Engine, prompts: Sequence[Sequence[int]], work: Work,
              abort: bool) -> list[GenerationOutput]:
    """Step until the wave is done; after a fault, step again, or (abort) abort what is
    not finished and run it again."""
    rids = [engine.add_request(p, work.max_new_tokens) for p in prompts]
    done: dict[int, GenerationOutput] = {}
    again: dict[int, int] = {}  # a request run again -> the one it replaces
    while engine.has_unfinished():
        try:
            done |= {o.request_id: o for o in engine.step()}
        except FAULTS:
            if abort:
                again |= abort_unfinished(engine, [r for r in rids if r not in done],
                                          work.max_new_tokens)
    if abort and not all(r in done for r in rids):  # one finished as its abort completed
        done |= {o.request_id: o for o in engine.step()}  # the step: nothing scheduled
    for rid, original in again.items():
        done[original] = done.pop(rid)
    return [done[r] for r in rids]


def abort_unfinished(engine: Engine, rids: list[int], max_new_tokens: int) -> dict[int, int]:
    """Abort each of `rids` (again, if an abort fails: a failed abort changed nothing;
    one that finished meanwhile comes out of the next step), check that nothing is left,
    and queue the aborted ones again; returns new id -> old id."""
    prompts: dict[int, list[int]] = {}
    for rid in rids:
        try:
            try:
                out = engine.abort(rid)
            except FAULTS:
                out = engine.abort(rid)
        except RequestFinishedError:
            continue
        prompts[rid] = list(out.prompt)
    where = f"after aborting {sorted(prompts)}"
    assert_clean(engine.manager, where)
    assert not engine.scheduler.running and not engine.scheduler.waiting, where
    return {engine.add_request(p, max_new_tokens): rid for rid, p in prompts.items()}


def run_generate(engine: Engine, prompts: Sequence[Sequence[int]],
                 work: Work) -> list[GenerationOutput]:
    try:
        return engine.generate(prompts, work.max_new_tokens)
    except FAULTS:
        assert not engine.has_unfinished(), "after the failed generate(): still queued"
        assert_clean(engine.manager, "after the failed generate()")
        return engine.generate(prompts, work.max_new_tokens)


class Reference(NamedTuple):
    """A workload's clean run (step loop) and cold outputs."""

    clean: Run
    cold: list[GenerationOutput]


@pytest.fixture(scope="session")
def reference(models: Callable[[str], Transformer]) -> Callable[[str], Reference]:
    """The clean run and cold outputs of a workload, made once for the run."""
    made: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in made:
            work = WORKS[name]
            model = models(work.preset)
            clean = run(model, work, FaultPlan(), "steps")
            cold = cold_outputs(model, work.prompts, work.max_new_tokens)
            assert_same_outputs(cold, clean.outputs, f"{name}: the clean run")
            assert_clean(clean.engine.manager, f"{name}: the clean run")
            made[name] = Reference(clean, cold)
        return made[name]

    return get


# A failed join gives its admission back to the cache: the cache sees an admission and a
# free the clean run did not, and may reuse less when the request is admitted again.
OWN_HISTORY = frozenset({"join"})


def check(models: Callable[[str], Transformer], ref: Reference, name: str, point: Point,
          recovery: Recovery) -> None:
    """One faulted run of workload `name`, recovered, against the clean and cold runs."""
    work = WORKS[name]
    points = [point]
    if recovery == "abort":  # its first abort fails too, with the other kind of fault
        points.append(Point("abort", 0, FAULTS[1 - FAULTS.index(point.error)]))
    r = run(models(work.preset), work, FaultPlan(*points), recovery)
    where = f"{name} ({recovery}), {point}"
    assert point in r.plan.fired, (f"{where}: the fault never struck "
                                   f"({r.plan.calls[point.phase]} calls)")
    if recovery == "abort":
        assert points[1] in r.plan.fired or not r.plan.calls["abort"], where
    assert_same_outputs(ref.cold, r.outputs, where)
    assert_clean(r.engine.manager, where)
    assert_provenance(r.engine)
    if recovery == "steps":  # the same work as the clean run
        clean = ref.clean.engine
        assert r.engine.num_steps == clean.num_steps, where
        if point.phase not in OWN_HISTORY:
            assert r.engine.admission_log() == clean.admission_log(), (
                f"{where}: the cache saw another history than the clean run's")
            assert r.engine.num_computed_tokens == clean.num_computed_tokens, where


Which = Literal["first", "middle", "last"]


def point_of(ref: Reference, phase: str, which: Which,
             error: type[BaseException]) -> Point:
    """The first, middle or last call of `phase` in the clean run."""
    n = ref.clean.plan.calls[phase]
    assert n, f"the workload never reaches {phase}"
    return Point(phase, {"first": 0, "middle": n // 2, "last": n - 1}[which], error)


# The pre-merge slice: every phase (but abort, which every abort recovery hits) with
# each fault kind on tiny, the recoveries in turn; then the phases each other workload
# adds: recurrent state and sampling (hybrid), window releases and preemption,
# interleaved offloads and onboards, and the packed layout's copies.
TINY_PHASES = [phase for phase in STEP_PHASES if phase not in ("abort", "recurrent")]
TINY_KINDS: tuple[tuple[Which, type[BaseException]], ...] = (("middle", InjectedFault),
                                                              ("last", Interrupt))
QUICK: list[tuple[str, str, Which, type[BaseException], Recovery]] = [
    *[("tiny-plain", phase, which, error, RECOVERIES[(i + j) % 3])
      for i, phase in enumerate(TINY_PHASES) for j, (which, error) in enumerate(TINY_KINDS)],
    ("hybrid-tiny-plain", "recurrent", "middle", InjectedFault, "steps"),
    ("hybrid-tiny-plain", "sample", "middle", Interrupt, "steps"),
    ("hybrid-tiny-plain", "commit", "middle", Interrupt, "generate"),
    ("hybrid-tiny-plain", "join", "middle", InjectedFault, "steps"),
    ("hybrid-tiny-host", "copy", "middle", InjectedFault, "abort"),
    ("tiny-swa-plain", "preempt", "first", Interrupt, "steps"),
    ("tiny-swa-plain", "sync", "middle", InjectedFault, "generate"),
    ("tiny-swa-plain", "copy", "first", InjectedFault, "abort"),
    ("tiny-mixed-swa-plain", "release", "first", InjectedFault, "steps"),
    ("tiny-mixed-swa-plain", "attention", "middle", Interrupt, "abort"),
    ("tiny-host", "copy", "middle", Interrupt, "steps"),
    ("tiny-host", "copy", "last", InjectedFault, "generate"),
    ("tiny-blhnc", "copy", "first", Interrupt, "steps"),
]


@pytest.mark.parametrize(("name", "phase", "which", "error", "recovery"), [
    pytest.param(*case, id=f"{case[0]}-{case[1]}-{case[2]}-{case[3].__name__}-{case[4]}")
    for case in QUICK])
def test_a_step_is_all_or_nothing_quick(models: Callable[[str], Transformer],
                                        reference: Callable[[str], Reference], name: str,
                                        phase: str, which: Which, error: type[BaseException],
                                        recovery: Recovery) -> None:
    ref = reference(name)
    check(models, ref, name, point_of(ref, phase, which, error), recovery)


# Each op of a batch leaves another prefix applied; each join another request to give
# back; each preemption another request to requeue.
EVERY_CALL = frozenset({"copy", "join", "preempt"})


@pytest.mark.slow
@pytest.mark.parametrize("recovery", RECOVERIES)
@pytest.mark.parametrize("phase", [p for p in STEP_PHASES if p != "abort"])
@pytest.mark.parametrize("name", list(WORKS))
def test_a_step_is_all_or_nothing_wide(models: Callable[[str], Transformer],
                                       reference: Callable[[str], Reference], name: str,
                                       phase: str, recovery: Recovery) -> None:
    """The first, middle and last call of `phase` (every call, for the few phases each
    call of which differs: EVERY_CALL), the fault kinds in turn (each kind at each phase
    with every recovery)."""
    ref = reference(name)
    n = ref.clean.plan.calls[phase]
    if not n:
        pytest.skip(f"{name}: never reaches {phase} (coverage: "
                    "test_the_workloads_reach_what_the_faults_must_hit)")
    spots = range(n) if phase in EVERY_CALL else sorted({0, n // 2, n - 1})
    shift = RECOVERIES.index(recovery)
    for i, at in enumerate(spots):
        check(models, ref, name, Point(phase, at, FAULTS[(i + shift) % 2]), recovery)


def test_the_workloads_reach_what_the_faults_must_hit(
        models: Callable[[str], Transformer], reference: Callable[[str], Reference]) -> None:
    """Every quick case's phase is reached where it is asked for, the quick cases cover
    every phase with each fault kind and every recovery on tiny, and every workload
    reaches every phase its model has (recurrent: hybrid only; copies: partial hits,
    which hybrid's snapshot alignment rules out, or the host tier; preemption: all but
    the host tier's). The tiny workload copies
    partial hits, the host one offloads and onboards (an onboard before an offload in
    one batch: re-running an applied op there is not safe), the hybrid one reuses from
    snapshots, the window one releases blocks and matches by the window: otherwise a
    fault there would test nothing."""
    for name, phase, which, error, _ in QUICK:
        point_of(reference(name), phase, which, error)  # asserts the phase is reached
    on_tiny = {(phase, error) for name, phase, _, error, _ in QUICK if name == "tiny-plain"}
    assert on_tiny == {(phase, error) for phase in TINY_PHASES for error in FAULTS}
    assert {case[4] for case in QUICK if case[0] == "tiny-plain"} == set(RECOVERIES)
    for name, work in WORKS.items():
        calls = reference(name).clean.plan.calls
        expected = set(STEP_PHASES) - {"abort"}
        if "hybrid" not in work.preset:
            expected.discard("recurrent")
        if work.spec.host:
            expected.discard("preempt")  # its batch holds two requests, its pool more
        elif "hybrid" in work.preset:
            expected.discard("copy")  # reuse is aligned to snapshots: no partial hit
        assert expected <= set(calls), f"{name} never reaches {expected - set(calls)}"
    stats = {name: reference(name).clean.engine.kv_cache_stats() for name in WORKS}
    assert stats["tiny-plain"].copied_blocks > 0
    host = stats["tiny-host"]
    assert host.offloaded_blocks > 0 and host.onboarded_blocks > 0
    kinds = ["".join(e["kind"][1] for e in batch)
             for batch in op_batches(reference("tiny-host").clean.engine)]
    assert any("nf" in k for k in kinds), f"no onboard followed by an offload: {kinds}"
    for name in ("hybrid-tiny-plain", "hybrid-tiny-host"):
        assert stats[name].reused_blocks > 0 and stats[name].state_snapshot_bytes > 0, name
    window = WORKS["tiny-swa-plain"]
    engine = window.spec.build(models(window.preset))
    released = 0
    for prompts in window.waves:
        for p in prompts:
            engine.add_request(p, window.max_new_tokens)
        while engine.has_unfinished():
            engine.step()
            released = max([released] + [r.seq.num_released_blocks
                                         for r in engine.scheduler.running if r.seq])
    assert released > 0 and stats["tiny-swa-plain"].reused_blocks > 0
    assert any(e["kind"] == "admit" and None in e["block_ids"]
               for e in engine.admission_log()), "no match skipped a block outside the window"


def op_batches(engine: Engine) -> list[list[dict[str, Any]]]:
    """The logged ops, grouped by the runs of consecutive op events (one step's batch)."""
    batches: list[list[dict[str, Any]]] = []
    previous = None
    for e in engine.admission_log():
        moved = e["kind"] in ("copy", "offload", "onboard")
        if moved and previous != "op":
            batches.append([])
        if moved:
            batches[-1].append(e)
        previous = "op" if moved else e["kind"]
    return batches


# -- the findings of issue 31 ------------------------------------------------------------------

ISSUE_SPEC = EngineSpec(4, 32, max_num_tokens=8)
ISSUE_PROMPTS = [P[:9], P[:10], [*P[:6], 40, 41, 42]]


def step_by_hand(engine: Engine, limit: int = 60) -> list[GenerationOutput | None]:
    """The issue's prompts, 4 new tokens each, stepped by hand; a step that raises is
    stepped again. Returns the outputs in prompt order (None: not finished in `limit`
    steps)."""
    rids = [engine.add_request(p, 4) for p in ISSUE_PROMPTS]
    done: dict[int, GenerationOutput] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            break
        try:
            done |= {o.request_id: o for o in engine.step()}
        except FAULTS:
            continue
    return [done.get(r) for r in rids]


def clean_issue_run(model: Transformer) -> tuple[Engine, list[GenerationOutput]]:
    """The issue's workload without a fault: its engine and outputs."""
    engine = ISSUE_SPEC.build(model)
    engine.step_fault = FaultPlan()
    outputs = step_by_hand(engine)
    assert all(o is not None for o in outputs)
    return engine, [o for o in outputs if o is not None]


@pytest.mark.parametrize("error", FAULTS)
@pytest.mark.parametrize("preset", ["hybrid-tiny", "tiny"])
def test_a_step_whose_sampling_raises_did_not_happen(models: Callable[[str], Transformer],
                                                     preset: str,
                                                     error: type[BaseException]) -> None:
    """Finding 1: the recurrent states were committed (snapshots saved, the step counted)
    before sampling, so the step retried after its sampling raised advanced them twice:
    request 0 gave [294, 294, 294, 294] on hybrid-tiny, the cold run [397, 294, 294,
    294]; on tiny the tokens were right but `num_steps` counted the failed step."""
    model = models(preset)
    clean, _ = clean_issue_run(model)
    engine = ISSUE_SPEC.build(model)
    plan = FaultPlan(Point("sample", 1, error))  # step 1's sampling
    engine.step_fault = plan
    outputs = step_by_hand(engine)
    assert plan.fired
    cold = cold_outputs(model, ISSUE_PROMPTS, 4)
    assert all(o is not None for o in outputs)
    assert_same_outputs(cold, [o for o in outputs if o is not None], preset)
    assert (engine.num_steps, engine.num_computed_tokens) == (clean.num_steps,
                                                             clean.num_computed_tokens)
    assert engine.admission_log() == clean.admission_log()
    assert_clean(engine.manager, preset)


@pytest.mark.parametrize("error", FAULTS)
@pytest.mark.parametrize("chunk", [0, 1, 2])
def test_a_postprocess_that_raises_part_way_is_completed(models: Callable[[str], Transformer],
                                                         chunk: int,
                                                         error: type[BaseException]) -> None:
    """Finding 2: when the commit of one of step 1's chunks raised, the chunks before it
    had been post-processed and the rest not, nothing was recounted, the next step()
    raised `PersistentBatch: slot 1 holds 3 blocks, but its page 3 is in block 3` (slot
    2 for the second chunk) and request 0 never finished. Now the next call completes
    the postprocess from the chunk that raised."""
    model = models("tiny")
    clean, clean_outputs = clean_issue_run(model)
    commits = [0]  # commit calls after each step of the clean run
    engine = ISSUE_SPEC.build(model)
    counting = FaultPlan()
    engine.step_fault = counting
    for p in ISSUE_PROMPTS:
        engine.add_request(p, 4)
    for _ in range(2):
        engine.step()
        commits.append(counting.calls["commit"])
    assert commits == [0, 1, 4], "step 1 should post-process three chunks, request 0's first"
    engine = ISSUE_SPEC.build(model)
    plan = FaultPlan(Point("commit", commits[1] + chunk, error))
    engine.step_fault = plan
    outputs = step_by_hand(engine)
    assert plan.fired
    assert all(o is not None for o in outputs), f"finished: {[o is not None for o in outputs]}"
    assert_same_outputs(clean_outputs, [o for o in outputs if o is not None], "tiny")
    assert engine.admission_log() == clean.admission_log()
    assert engine.num_steps == clean.num_steps
    assert_clean(engine.manager, "tiny")


@pytest.mark.parametrize("error", FAULTS)
def test_a_batch_join_that_raises_is_undone(models: Callable[[str], Transformer],
                                            error: type[BaseException]) -> None:
    """Finding 3: when an admitted request's batch row raised inside generate(), the
    request was admitted and off the waiting queue, in neither queue: its blocks stayed
    held for the engine's life (`sequence 1 is still live`), even after a retry. Now the
    admission is given back and the request waits first in the queue."""
    model = models("tiny")
    cold = cold_outputs(model, ISSUE_PROMPTS, 4)
    engine = ISSUE_SPEC.build(model)
    engine.step_fault = FaultPlan(Point("join", 1, error))  # request 1's join
    for p in ISSUE_PROMPTS:
        engine.add_request(p, 4)
    engine.step()  # admits request 0
    with pytest.raises(error):
        engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == [1, 2]
    assert [r.request_id for r in engine.scheduler.running] == [0]
    assert list(engine.manager.sequences) == [0]  # request 1's admission was given back
    engine.manager.check_integrity()
    outputs = step_by_hand(engine)
    assert all(o is not None for o in outputs)
    assert_same_outputs(cold, [o for o in outputs if o is not None], "step loop")
    assert_clean(engine.manager, "step loop")

    engine = ISSUE_SPEC.build(model)
    engine.step_fault = FaultPlan(Point("join", 1, error))
    with pytest.raises(error):
        engine.generate(ISSUE_PROMPTS, 4)
    assert not engine.has_unfinished()
    assert_clean(engine.manager, "after the failed generate()")
    assert_same_outputs(cold, engine.generate(ISSUE_PROMPTS, 4), "generate again")
    assert_clean(engine.manager, "generate again")
