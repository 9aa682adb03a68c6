"""A step that raises did not happen: transient faults injected into the step's parts.

A CUDA out-of-memory error or an interrupt can strike anywhere inside a step. The engine's
rule (Engine._step, kvcache/engine/engine.py) is that a step whose copies or forward raise did not
happen: the ops not applied stay queued, the batch is recounted, every request keeps its
recurrent state, tokens and counts, and the next step runs the same work again. A
`generate()` that raises aborts what it added. Each case here injects one fault at a
chosen point of a workload, lets the caller recover (a step loop that steps again, or a
new `generate()` for the wave that failed), and checks that the outputs equal a cold
run, that nothing leaked, that the provenance oracle finds every read of the reader's own
KV, and (step loop) that the recovered run did exactly the clean run's work: the same
cache log, steps and computed tokens.

Where a fault strikes (each consulted by a `OneFault`, which numbers the calls and raises
at one of them):
- plan: the attention backend's per-step plan (`RaisingBackend`, a subclass of the torch
  reference backend), before any layer ran;
- attention: one attention layer's call, after it appended its KV (`RaisingBackend`);
- layer: after one transformer block ran (a forward hook on `model.layers[i]`): for a
  hybrid model, after the recurrent layer computed every request's new state;
- copies: `KvStorage.apply_copies`, after it applied the first k ops of a batch (the
  storage's own method, called for those k, then the fault).
The faults are a RuntimeError (as CUDA out of memory is) or an `Interrupt`, which, like
KeyboardInterrupt, is not an Exception.

The workloads: the tiny model with shared prefixes and partial copies, hybrid-tiny
(recurrent state and its snapshots), a sliding-window preset whose requests release
blocks, and the tiny model over a host tier (offloads and onboards in one queue). The
quick tests pick a few points of each; the full ones try every point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple

import pytest
import torch
from torch import nn

from kvcache import Engine
from kvcache.attention.metadata import PagedMetadata
from kvcache.attention.reference import ReferenceBackend
from kvcache.core.ops import KvOp
from kvcache.engine import GenerationOutput
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


class OneFault:
    """Numbers the calls of one fault point (`tick`) and raises `error` at call `at`,
    once (None: never, to count the calls of a clean run)."""

    def __init__(self, at: int | None = None,
                 error: type[BaseException] = InjectedFault) -> None:
        self.at = at
        self.error = error
        self.calls = 0
        self.fired = False

    def tick(self, what: str) -> None:
        """One call of the point; raises at call `at`."""
        n, self.calls = self.calls, self.calls + 1
        if n == self.at:
            self.fired = True
            raise self.error(f"injected fault at {what} call {n}")


class RaisingBackend(ReferenceBackend):
    """The torch reference backend; its `plan` and `attention` faults strike in the
    per-step plan and in an attention layer's call, after that layer appended its KV."""

    name: ClassVar[str] = "test-raising"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults: dict[str, OneFault] = {}

    def _plan(self, md: PagedMetadata) -> None:
        if "plan" in self.faults:
            self.faults["plan"].tick("plan")
        super()._plan(md)

    def _attend(self, layer: int, md: PagedMetadata, q: torch.Tensor,
                return_lse: bool) -> Any:
        if "attention" in self.faults:
            self.faults["attention"].tick("attention")
        return super()._attend(layer, md, q, return_lse)


def fail_copies(engine: Engine, fault: OneFault, after_ops: int) -> list[int]:
    """Make the engine's storage fail at `fault`'s call (its non-empty batches counted)
    after applying the batch's first `after_ops` ops (all but one, if the batch is
    shorter), through its own apply_copies; returns the size of every batch it was given."""
    storage = engine.storage
    apply = storage.apply_copies
    sizes: list[int] = []

    def apply_copies(ops: Sequence[KvOp]) -> None:
        sizes.append(len(ops))
        try:
            fault.tick("apply_copies")
        except FAULTS:
            apply(ops[:min(after_ops, len(ops) - 1)])  # sets storage.num_applied
            raise
        apply(ops)

    storage.apply_copies = apply_copies  # type: ignore[method-assign]
    return sizes


@contextmanager
def fail_after_layer(model: Transformer, layer: int, fault: OneFault) -> Iterator[None]:
    """`fault` strikes right after `model.layers[layer]` ran (a forward hook, removed on
    exit: the model is shared)."""
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        fault.tick(f"layer {layer}")

    handle = model.layers[layer].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# -- workloads --------------------------------------------------------------------------------

P = list(range(1, 50))  # a stem the prompts share


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


WORKS = {
    # shared prefixes, partial hits copied (BlockCopy), prefills chunked
    "tiny": Work("tiny", EngineSpec(4, 32, max_num_tokens=8), (
        wave(P[:9], P[:10], [*P[:6], 40, 41, 42]),
        wave(P[:11], [*P[:6], 40, 41, 50]),
    )),
    # recurrent state per request, snapshots at block ends, reuse aligned to them
    "hybrid": Work("hybrid-tiny", EngineSpec(4, 32, max_num_tokens=8), (
        wave(P[:9], [*P[:8], 60, 61]),
        wave(P[:13], [*P[:8], 60, 62]),
    )),
    # a 32-token window: the requests release blocks no later token sees
    "window": Work("tiny-swa", EngineSpec(4, 24, max_num_tokens=16), (
        wave(P[:40], [*P[:36], 70, 71, 72]),
        wave(P[:44],),
    )),
    # a device pool of 10 blocks over a host tier: evictions offload, hits onboard, and
    # one step's batch interleaves offloads and onboards into the blocks they freed
    "host": Work("tiny", EngineSpec(4, 10, max_num_tokens=16, max_batch_size=2, host=24), (
        wave(P[:16], P[20:30]),
        wave(P[30:46],),
        wave(P[:17], P[20:31]),
        wave(P[30:47],),
    )),
}
# the wider post-merge runs add hybrid-tiny over a host tier (snapshots follow blocks)
FULL_WORKS = {**WORKS, "hybrid-host": Work("hybrid-tiny", EngineSpec(
    4, 10, max_num_tokens=16, max_batch_size=2, host=24), WORKS["host"].waves)}
SITES = ("plan", "attention", "layer", "copies")


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

class Point(NamedTuple):
    """Where the fault strikes: the `at`-th call of `site`, and for `copies` how many ops
    of that batch were applied first."""

    site: str
    at: int | None = None
    after_ops: int = 0
    error: type[BaseException] = InjectedFault

    def __str__(self) -> str:
        ops = f" after {self.after_ops} ops" if self.site == "copies" else ""
        return f"{self.error.__name__} at {self.site} call {self.at}{ops}"


CLEAN = Point("none")  # a run without a fault: every point's calls counted


class Run(NamedTuple):
    """A workload's engine and outputs (in prompt order); a fault per site (their
    `calls`, in a clean run, number the points there are) and the size of each batch of
    ops applied."""

    engine: Engine
    outputs: list[GenerationOutput]
    faults: dict[str, OneFault]
    copy_batches: list[int]


def run(model: Transformer, work: Work, point: Point, step_loop: bool) -> Run:
    """`work` with a fault at `point` (every other site only counts its calls); the
    caller recovers by stepping again (step loop) or by running the failed wave's
    generate() again."""
    engine = replace(work.spec, attn_backend=RaisingBackend).build(model)
    faults = {site: OneFault(point.at, point.error) if site == point.site else OneFault()
              for site in SITES}
    assert isinstance(engine.backend, RaisingBackend)
    engine.backend.faults = {"plan": faults["plan"], "attention": faults["attention"]}
    batches = fail_copies(engine, faults["copies"], point.after_ops)
    outputs: list[GenerationOutput] = []
    with fail_after_layer(model, layer_of(model), faults["layer"]):
        for prompts in work.waves:
            outputs += (run_steps if step_loop else run_generate)(engine, prompts, work,
                                                                   point)
    return Run(engine, outputs, faults, batches)


def layer_of(model: Transformer) -> int:
    """The block a layer fault follows: a hybrid model's first recurrent layer (its
    states are computed, the later layers have not run), else the middle one."""
    recurrent = model.config.recurrent_layers
    return recurrent[0] if recurrent else model.config.num_layers // 2


def run_steps(engine: Engine, prompts: Sequence[Sequence[int]], work: Work,
              point: Point) -> list[GenerationOutput]:
    rids = [engine.add_request(p, work.max_new_tokens) for p in prompts]
    done: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        try:
            done |= {o.request_id: o for o in engine.step()}
        except FAULTS:
            continue  # the step did not happen: step again
    return [done[r] for r in rids]


def run_generate(engine: Engine, prompts: Sequence[Sequence[int]], work: Work,
                 point: Point) -> list[GenerationOutput]:
    try:
        return engine.generate(prompts, work.max_new_tokens)
    except FAULTS:
        where = f"{point}: after the failed generate()"
        assert not engine.has_unfinished(), f"{where}: its requests are still queued"
        assert_clean(engine.manager, where)
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
            work = FULL_WORKS[name]
            model = models(work.preset)
            clean = run(model, work, CLEAN, step_loop=True)
            cold = cold_outputs(model, work.prompts, work.max_new_tokens)
            assert_same_outputs(cold, clean.outputs, f"{name}: the clean run")
            made[name] = Reference(clean, cold)
        return made[name]

    return get


def check(models: Callable[[str], Transformer], ref: Reference, name: str, point: Point,
          step_loop: bool) -> None:
    """One faulted run of workload `name`, recovered, against the clean and cold runs."""
    work = FULL_WORKS[name]
    r = run(models(work.preset), work, point, step_loop)
    where = f"{name} ({'step loop' if step_loop else 'generate'}), {point}"
    fault = r.faults[point.site]
    assert fault.fired, f"{where}: the fault never struck ({fault.calls} calls)"
    assert_same_outputs(ref.cold, r.outputs, where)
    assert_clean(r.engine.manager, where)
    assert_provenance(r.engine)
    if step_loop:  # the failed step did not happen: the same work as the clean run
        clean = ref.clean.engine
        assert r.engine.admission_log() == clean.admission_log(), (
            f"{where}: the cache saw another history than the clean run's")
        assert (r.engine.num_steps, r.engine.num_computed_tokens) == (
            clean.num_steps, clean.num_computed_tokens), where


def points(clean: Run, site: str, which: Sequence[str] | None = None) -> list[Point]:
    """The fault points of `site` in `clean`: every call (and for copies, every op count
    of every batch) when `which` is None, else the "first", "middle" or "last" (for
    copies: before the first batch's first op, half-way through the longest batch, or
    before the last batch's last op). The errors alternate."""
    if site == "copies":
        sizes = clean.copy_batches
        longest = max(range(len(sizes)), key=sizes.__getitem__, default=0)
        named = {"first": (0, 0), "middle": (longest, sizes[longest] // 2 if sizes else 0),
                 "last": (len(sizes) - 1, sizes[-1] - 1 if sizes else 0)}
        spots = ([(i, k) for i, n in enumerate(sizes) for k in range(n)] if which is None
                 else [named[w] for w in which] if sizes else [])
    else:
        n = clean.faults[site].calls
        named = {"first": (0, 0), "middle": (n // 2, 0), "last": (n - 1, 0)}
        spots = list(zip(range(n), [0] * n, strict=True)) if which is None else [
            named[w] for w in which]
    return [Point(site, at, k, FAULTS[i % 2]) for i, (at, k) in enumerate(spots)]


# The pre-merge slice: each workload, each site where it matters, both recoveries. The
# hybrid's layer fault follows its recurrent layer (finding 1: states written, later
# layers not run); the host's copies fail part-way through batches that move blocks both
# ways (finding 2); every generate() case checks what a failed call leaves (finding 3).
QUICK = [
    pytest.param(name, site, which, step_loop, id=f"{name}-{site}-{which}-"
                 f"{'steps' if step_loop else 'generate'}")
    for name, site, which, step_loop in (
        ("tiny", "plan", "middle", True),
        ("tiny", "attention", "last", False),
        ("tiny", "copies", "first", True),
        ("tiny", "layer", "first", False),
        ("hybrid", "layer", "middle", True),
        ("hybrid", "layer", "first", False),
        ("hybrid", "attention", "middle", True),
        ("window", "attention", "middle", True),
        ("window", "layer", "last", False),
        ("host", "copies", "middle", True),
        ("host", "copies", "last", False),
        ("host", "plan", "middle", False),
    )]


@pytest.mark.parametrize(("name", "site", "which", "step_loop"), QUICK)
def test_a_step_that_raises_did_not_happen_quick(models: Callable[[str], Transformer],
                                                 reference: Callable[[str], Reference],
                                                 name: str, site: str, which: str,
                                                 step_loop: bool) -> None:
    ref = reference(name)
    (point,) = points(ref.clean, site, [which])
    check(models, ref, name, point, step_loop)


@pytest.mark.slow
@pytest.mark.parametrize("step_loop", [pytest.param(True, id="steps"),
                                       pytest.param(False, id="generate")])
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("name", list(FULL_WORKS))
def test_a_step_that_raises_did_not_happen_full(models: Callable[[str], Transformer],
                                                reference: Callable[[str], Reference],
                                                name: str, site: str,
                                                step_loop: bool) -> None:
    ref = reference(name)
    every = points(ref.clean, site)
    if not every:
        pytest.skip(f"{name}: no {site} calls (the workload queues no ops)")
    for point in every:
        check(models, ref, name, point, step_loop)


def test_the_workloads_reach_what_the_faults_must_hit(
        models: Callable[[str], Transformer], reference: Callable[[str], Reference]) -> None:
    """The tiny workload copies partial hits, the host one offloads and onboards (an
    onboard before an offload in one batch: re-running an applied op there is not safe),
    the hybrid one reuses from snapshots, the window one releases blocks and matches by
    the window: otherwise a fault there would test nothing."""
    stats = {name: reference(name).clean.engine.kv_cache_stats() for name in WORKS}
    assert stats["tiny"].copied_blocks > 0
    assert stats["host"].offloaded_blocks > 0 and stats["host"].onboarded_blocks > 0
    kinds = ["".join(e["kind"][1] for e in batch)
             for batch in op_batches(reference("host").clean.engine)]
    assert any("nf" in k for k in kinds), f"no onboard followed by an offload: {kinds}"
    assert stats["hybrid"].reused_blocks > 0 and stats["hybrid"].state_snapshot_bytes > 0
    window = WORKS["window"]
    engine = window.spec.build(models(window.preset))
    released = 0
    for prompts in window.waves:
        for p in prompts:
            engine.add_request(p, window.max_new_tokens)
        while engine.has_unfinished():
            engine.step()
            released = max([released] + [r.seq.num_released_blocks
                                         for r in engine.scheduler.running if r.seq])
    assert released > 0 and stats["window"].reused_blocks > 0
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
