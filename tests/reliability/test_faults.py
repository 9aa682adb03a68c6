"""Allocation faults injected at every allocation point of small workloads.

The manager's `allocation_fault` seam is consulted as (operation, blocks needed) before
every allocation; returning True makes that allocation raise OutOfBlocksError before
anything changes. A workload is first run clean to number its allocation points; then,
for every k, the k-th allocation (and, in a second pass, the k-th and the next one) fails.

What the engine does with a fault (kvcache/engine/scheduler.py, kvcache/engine/engine.py): a failed
admission leaves the request waiting for the next step (even on an idle engine); a failed
decode allocation preempts the request, which is recomputed later, reusing what it
committed. Either way the outputs must equal a cold run, nothing may leak, and the cache
must stay intact. A fault that never passes ends generate() with a clear error.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest

from harness.reuse.assertions import predict_from_engine
from kvcache import Engine, KvCacheConfig, KvCacheManager, OutOfBlocksError, ReuseScope
from kvcache.engine import GenerationOutput
from kvcache.model import Transformer
from tests.reliability.support import EngineSpec, assert_clean, assert_same_outputs, cold_outputs

P = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # a stem the workloads share
SALT = ReuseScope(salt=7)


class Req(NamedTuple):
    """One request of a workload: prompt and reuse scope."""

    prompt: tuple[int, ...]
    scope: ReuseScope | None = None


@dataclass(frozen=True)
class Workload:
    """Waves of requests; each wave is one `generate` call, run to completion."""

    spec: EngineSpec
    waves: tuple[tuple[Req, ...], ...]
    max_new_tokens: int = 3

    @property
    def requests(self) -> list[Req]:
        return [r for wave in self.waves for r in wave]


def req(tokens: list[int], scope: ReuseScope | None = None) -> Req:
    return Req(tuple(tokens), scope)


WORKLOADS = [
    pytest.param(Workload(EngineSpec(4, 32), (
        (req(P[:9]), req(P[:10]), req([*P[:6], 40, 41, 42])),
        (req(P[:11]), req([*P[:6], 40, 41, 50])),
    ), max_new_tokens=5), id="b4-shared-prefix"),
    pytest.param(Workload(EngineSpec(4, 32, max_num_tokens=5), (
        (req(P[:11]), req([*P[:8], 30, 31, 32])),
    ), max_new_tokens=4), id="b4-chunked"),
    pytest.param(Workload(EngineSpec(2, 10), (
        (req(P[:5]), req([*P[:4], 60]), req([70, 71, 72, 73, 74])),
    ), max_new_tokens=4), id="b2-tight-pool"),
    pytest.param(Workload(EngineSpec(4, 32), (
        (req(P[:7]), req(P[:7], SALT)),
        (req([*P[:6], 90, 91]), req(P[:10], SALT)),
    ), max_new_tokens=5), id="b4-scopes-partial"),
    pytest.param(Workload(EngineSpec(1, 40, max_num_tokens=4), (
        (req(P[:3]), req([*P[:2], 80])),
        (req(P[:3]),),
    ), max_new_tokens=5), id="b1-every-token"),
]


class FaultPoint(NamedTuple):
    """One allocation the manager asked about; `running` requests were running then."""

    number: int
    operation: str
    blocks: int
    running: int


class FaultInjector:
    """The `allocation_fault` seam: numbers every allocation, fails those in `fail`."""

    def __init__(self, engine: Engine, fail: frozenset[int]) -> None:
        self.engine = engine
        self.fail = fail
        self.points: list[FaultPoint] = []

    def __call__(self, operation: str, blocks: int) -> bool:
        point = FaultPoint(len(self.points), operation, blocks,
                           len(self.engine.scheduler.running))
        self.points.append(point)
        return point.number in self.fail

    @property
    def injected(self) -> list[FaultPoint]:
        return [p for p in self.points if p.number in self.fail]


class Run(NamedTuple):
    """A workload's outputs in request order (None if generate raised), and its engine."""

    engine: Engine
    injector: FaultInjector
    outputs: list[GenerationOutput] | None
    error: Exception | None


def run(model: Transformer, work: Workload, fail: frozenset[int]) -> Run:
    engine = work.spec.build(model)
    injector = FaultInjector(engine, fail)
    engine.manager.state.allocation_fault = injector
    outputs: list[GenerationOutput] = []
    for wave in work.waves:
        try:
            outputs += engine.generate([list(r.prompt) for r in wave], work.max_new_tokens,
                                       [r.scope for r in wave])
        except Exception as exc:  # a fault surfacing to the caller is what we look for
            return Run(engine, injector, None, exc)
    return Run(engine, injector, outputs, None)


def fault_sets(points: list[FaultPoint]) -> list[frozenset[int]]:
    """Every single allocation point, then every pair of consecutive points."""
    n = len(points)
    return [frozenset({k}) for k in range(n)] + [frozenset({k, k + 1}) for k in range(n)]


def check_run(r: Run, work: Workload, cold: list[GenerationOutput], clean: Run) -> None:
    where = f"faults at {[tuple(p) for p in r.injector.injected]}"
    assert r.error is None, f"{where}: generate raised {type(r.error).__name__}: {r.error}"
    assert r.outputs is not None
    assert_same_outputs(cold, r.outputs, where)
    assert_clean(r.engine.manager, where)
    assert clean.outputs is not None
    natural = sum(o.num_preemptions for o in clean.outputs)
    if natural == 0:  # with room to spare, every failed decode allocation preempts once
        failed_appends = sum(p.operation == "append_tokens" for p in r.injector.injected)
        got = sum(o.num_preemptions for o in r.outputs)
        assert got == failed_appends, f"{where}: {got} preemptions, expected {failed_appends}"
    stats = r.engine.kv_cache_stats()
    if stats.evicted_blocks == 0:  # the oracle is exact without eviction
        predicted = predict_from_engine(r.engine)
        assert predicted.totals.reused_blocks == stats.reused_blocks, (
            f"{where}: reusedBlocks {stats.reused_blocks}, oracle "
            f"{predicted.totals.reused_blocks}")


@pytest.mark.parametrize("work", WORKLOADS)
def test_engine_absorbs_a_fault_at_every_allocation(tiny_model: Transformer,
                                                     work: Workload) -> None:
    cold = cold_outputs(tiny_model, [list(r.prompt) for r in work.requests],
                        work.max_new_tokens)
    clean = run(tiny_model, work, frozenset())
    check_run(clean, work, cold, clean)
    points = clean.injector.points
    kinds = {(p.operation, p.running > 0) for p in points}
    # admissions into an idle engine and beside running requests, and decode allocations
    assert kinds >= {("add_sequence", False), ("add_sequence", True),
                     ("append_tokens", True)}, f"workload too small: {points}"
    for fail in fault_sets(points):
        check_run(run(tiny_model, work, fail), work, cold, clean)


class Always:
    """A fault that never passes: every allocation of `operation` fails."""

    def __init__(self, operation: str) -> None:
        self.operation = operation
        self.failed = 0

    def __call__(self, operation: str, blocks: int) -> bool:
        self.failed += operation == self.operation
        return operation == self.operation


def test_decode_allocations_that_always_fail_still_finish(tiny_model: Transformer) -> None:
    """Each preemption keeps the token sampled before it, so every request still
    finishes, recomputing its context once per token that needed a new block."""
    prompts = [P[:5], [*P[:3], 70, 71]]
    engine = EngineSpec(2, 32).build(tiny_model)
    fault = Always("append_tokens")
    engine.manager.state.allocation_fault = fault
    outs = engine.generate(prompts, max_new_tokens=6)
    assert_same_outputs(cold_outputs(tiny_model, prompts, 6), outs, "appends always failing")
    assert fault.failed > 0
    assert sum(o.num_preemptions for o in outs) == fault.failed
    assert_clean(engine.manager, "appends always failing")


def test_admissions_that_always_fail_end_in_a_clear_error(tiny_model: Transformer) -> None:
    engine = EngineSpec(4, 32).build(tiny_model)
    fault = Always("add_sequence")
    engine.manager.state.allocation_fault = fault
    with pytest.raises(RuntimeError, match=r"generate: no progress in \d+ steps with nothing "
                                           r"running"):
        engine.generate([P[:5], P[:6]], max_new_tokens=2)
    assert fault.failed > 1, "the engine retried before giving up"
    assert not engine.has_unfinished(), "the failed generate() left its requests queued"
    assert_clean(engine.manager, "after the failed generate()")
    engine.manager.state.allocation_fault = None
    prompts = [P[:5]]
    assert_same_outputs(cold_outputs(tiny_model, prompts, 2),
                        engine.generate(prompts, max_new_tokens=2), "once the fault is gone")


def test_the_stall_error_counts_the_stalled_requests(tiny_model: Transformer) -> None:
    engine = EngineSpec(4, 32).build(tiny_model)
    engine.manager.state.allocation_fault = Always("add_sequence")
    with pytest.raises(RuntimeError, match=r"; 2 of its requests could not be admitted"):
        engine.generate([P[:5], P[:6]], max_new_tokens=2)


# -- the manager alone: a failed allocation changes nothing -------------------------------

Op = tuple[Any, ...]  # ("add", id, tokens[, scope]) | ("commit", id, n) | ("append", id, tokens) | ("free", id)

SCRIPT: list[Op] = [
    ("add", "a", P[:10]), ("commit", "a", 10), ("append", "a", [50, 51]),
    ("append", "a", [52]), ("commit", "a", 12), ("free", "a"),
    ("add", "b", [*P[:6], 99, 98]),          # a partial hit inside an interior block: copy
    ("add", "c", P[:10], SALT),              # another scope: nothing to reuse
    ("add", "d", P[:11]),                    # full blocks plus a claimed partial leaf
    ("commit", "b", 8), ("commit", "c", 10), ("free", "b"), ("free", "c"),
    ("append", "d", [60, 61, 62, 63]), ("commit", "d", 11),
    ("add", "e", [80, 81, 82, 83, 84, 85, 86, 87, 88]),  # needs eviction
    ("free", "d"), ("commit", "e", 9), ("append", "e", [89, 90, 91, 92]), ("free", "e"),
]


def apply(mgr: KvCacheManager, op: Op) -> None:
    kind, seq_id = op[0], op[1]
    if kind == "add":
        mgr.add_sequence(seq_id, op[2], op[3] if len(op) > 3 else None)
    elif kind == "commit":
        mgr.commit(seq_id, op[2])
    elif kind == "append":
        mgr.append_tokens(seq_id, op[2])
    else:
        mgr.free_sequence(seq_id)


def snapshot(mgr: KvCacheManager) -> tuple[Any, ...]:
    """Everything observable about the cache, block ids and pool order included."""
    seqs: dict[Hashable, Any] = {
        sid: (list(s.block_ids), s.num_tokens, s.num_committed_tokens, s.num_cached_tokens)
        for sid, s in mgr.sequences.items()}
    state = mgr.state
    return (state.tree.dump(), mgr.stats(), seqs, mgr.pending_copy_ops, list(state.pool.free),
            len(state.events or ()))


def new_manager() -> KvCacheManager:
    return KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8),
                          record_events=True)


def test_manager_fault_at_every_allocation_changes_nothing() -> None:
    calls: list[str] = []

    def count(op: str, n: int) -> bool:
        calls.append(op)
        return False

    clean = new_manager()
    clean.state.allocation_fault = count
    for op in SCRIPT:
        apply(clean, op)
        clean.take_copy_ops()
    assert {"add_sequence", "append_tokens"} <= set(calls) and clean.stats().evicted_blocks
    assert clean.stats().copied_blocks and clean.stats().claimed_blocks
    for k in range(len(calls)):
        mgr = new_manager()
        seen = [0]

        def fault(op: str, n: int, k: int = k, seen: list[int] = seen) -> bool:
            seen[0] += 1
            return seen[0] - 1 == k

        mgr.state.allocation_fault = fault
        for step, op in enumerate(SCRIPT):
            before = snapshot(mgr)
            try:
                apply(mgr, op)
            except OutOfBlocksError as exc:
                assert "[injected fault]" in str(exc) and repr(op[1]) in str(exc), str(exc)
                assert snapshot(mgr) == before, f"fault {k} at step {step} {op} changed the cache"
                mgr.check_integrity()
                apply(mgr, op)  # the same operation succeeds once the fault has passed
            mgr.take_copy_ops()
            mgr.check_integrity()
        assert snapshot(mgr) == snapshot(clean), f"fault {k} left a trace"
        assert_clean(mgr, f"fault {k}")
