"""Proves the packed BLHNC layout computes exactly what the per-layer layouts compute.

Every scenario family's workload (cold/warm, partial reuse by copy, chunked prefill,
padded decode, eviction, preemption, scopes) runs on a per-layer engine (NHD, or HND
re-paged) and on a packed one (BLHNC, paged alike). On the torch backend the generated
tokens, reuse statistics and logits must be identical, bit for bit: the packed engine's
appends, copies and reads go through its strided views. FlashInfer (GPU contexts) is
teacher-forced and compared within the backend's tolerance.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

from harness.workloads import shared_system_prompt
from kvcache import Engine, GenerationOutput, ReuseScope
from tests.scenarios.support import (
    ALL_BACKENDS,
    COPY,
    NO_PARTIAL,
    VOCAB,
    BackendSpec,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    prompts_of,
    tokens,
    unlike,
)

Force = list[list[int]] | None
NEW = 3


def generate(engine: Engine, prompts: list[list[int]], new: int, force: Force, start: int,
             scopes: list[ReuseScope | None] | None = None) -> list[GenerationOutput]:
    """engine.generate, teacher-forced with force[start:] when forcing."""
    return engine.generate(prompts, new, scopes,
                           force_tokens=force[start:start + len(prompts)] if force else None)


def cold_warm(engine: Engine, force: Force) -> list[GenerationOutput]:
    """The same three prompts twice: the second run reuses all but the last token."""
    prompts = prompts_of(17, [17, 17, 17])
    return generate(engine, prompts, NEW, force, 0) + generate(engine, prompts, NEW, force, 3)


def partial_copy(engine: Engine, force: Force) -> list[GenerationOutput]:
    """Q shares 2.5 blocks of A while A still decodes: Q's half block is a copy."""
    rng = random.Random(4)
    a = tokens(rng, 12)
    q = [*a[:10], unlike(a[10]), *tokens(rng, 3)]
    ra = engine.add_request(a, 4, force_tokens=force[0] if force else None)
    done = {o.request_id: o for o in engine.step()}
    rq = engine.add_request(q, 2, force_tokens=force[1] if force else None)
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    assert engine.kv_cache_stats().copied_blocks == 1, "the workload was meant to copy"
    return [done[ra], done[rq]]


def chunked(engine: Engine, force: Force) -> list[GenerationOutput]:
    """A 7-token budget cuts blocks and cached prefixes; run cold, then warm."""
    prompts = shared_system_prompt(3, 13, 8, vocab=VOCAB, seed=5)
    return generate(engine, prompts, NEW, force, 0) + generate(engine, prompts, NEW, force, 3)


def padded_decode(engine: Engine, force: Force) -> list[GenerationOutput]:
    """Two warm prompts decode beside three fresh ones; batches shrink 5 -> 3 -> 1,
    padded to 8, 4, 1, while sequences cross blocks (and pages)."""
    prompts = prompts_of(6, [9, 11, 6, 5, 8])
    news = [7, 10, 7, 10, 12]
    out = generate(engine, prompts[:2], 2, force, 0)
    rids = [engine.add_request(p, n, force_tokens=force[2 + i] if force else None)
            for i, (p, n) in enumerate(zip(prompts, news, strict=True))]
    done: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    return out + [done[r] for r in rids]


def eviction(engine: Engine, force: Force) -> list[GenerationOutput]:
    """Three rounds of nine prompts in three groups through a 16-block pool."""
    prompts = shared_system_prompt(9, 18, 5, num_groups=3, vocab=VOCAB, seed=4)
    outs: list[GenerationOutput] = []
    for shift in range(3):
        outs += generate(engine, prompts[shift:] + prompts[:shift], NEW, force, len(outs))
    assert engine.kv_cache_stats().evicted_blocks > 0, "the pool was meant to evict"
    return outs


def preemption(engine: Engine, force: Force) -> list[GenerationOutput]:
    """Decoding requests outgrow a 9-block pool: some are preempted and recomputed."""
    prompts = prompts_of(8, [6, 6, 6])
    prompts[2] = [*prompts[0][:5], unlike(prompts[0][5])]
    outs = generate(engine, prompts, 6, force, 0)
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to preempt"
    return outs + generate(engine, prompts, 6, force, 3)


def scopes(engine: Engine, force: Force) -> list[GenerationOutput]:
    """One prompt in four scopes, twice: each reuses only its own scope's blocks."""
    prompt = prompts_of(9, [14])[0]
    scoped: list[ReuseScope | None] = [None, ReuseScope(salt=1), ReuseScope(salt=1),
                                       ReuseScope(lora_id=2)]
    first = generate(engine, [prompt] * 4, NEW, force, 0, scoped)
    return first + generate(engine, [prompt] * 4, NEW, force, 4, scoped)


class Workload(NamedTuple):
    """A family's workload: block size, reuse mode, engine options, the run."""

    block: int
    mode: ReuseMode
    options: dict[str, Any]
    run: Callable[[Engine, Force], list[GenerationOutput]]
    oracle_exact: bool = True  # False: the bounded pool's bound (needs partial reuse off)


WORKLOADS = [
    pytest.param(Workload(4, COPY, {}, cold_warm), id="cold-warm"),
    pytest.param(Workload(4, COPY, {}, partial_copy), id="partial"),
    pytest.param(Workload(4, COPY, {"max_num_tokens": 7}, chunked), id="chunked"),
    pytest.param(Workload(4, COPY, {"pad_decode": True, "graph_batch_sizes": (1, 2, 4, 8)},
                          padded_decode), id="padded-decode"),
    pytest.param(Workload(4, NO_PARTIAL, {"max_num_blocks": 16}, eviction,
                          oracle_exact=False), id="eviction"),
    pytest.param(Workload(2, NO_PARTIAL, {"max_num_blocks": 9}, preemption,
                          oracle_exact=False), id="preemption"),
    pytest.param(Workload(4, COPY, {}, scopes), id="scopes"),
]
# (per-layer layout, packed engine re-paged too): kernel pages of half a block, or whole blocks
PAIRS = [pytest.param(("NHD", False), id="nhd"), pytest.param(("HND", True), id="hnd-repaged")]


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_packed_equals_per_layer(make_engine: EngineFactory, scenario: ScenarioRun,
                                 backend: BackendSpec, workload: Workload,
                                 pair: tuple[str, bool]) -> None:
    per_layer, repaged = pair
    page_size = workload.block // 2 if repaged else None

    def engine(layout: str) -> Engine:
        return make_engine(workload.block, backend=backend, mode=workload.mode,
                           layout=layout, page_size=page_size, **workload.options)

    reference, packed = engine(per_layer), engine("BLHNC")
    assert packed.storage.layout == "BLHNC" and len(packed.storage.tensors) == 2
    expected = workload.run(reference, None)
    bitwise = backend.attn == "torch"  # same float32 math over the same values
    force = None if bitwise else [list(o.token_ids) for o in expected]
    got = workload.run(packed, force)
    assert_same_outputs(expected, got, backend, f"BLHNC vs {per_layer}")
    if bitwise:
        for exp, act in zip(expected, got, strict=True):
            assert act.logits is not None and exp.logits is not None
            assert torch.equal(act.logits, exp.logits), (
                f"request {act.request_id}: logits differ by up to "
                f"{(act.logits - exp.logits).abs().max().item():.3g}")
    assert [o.kv_metrics for o in got] == [o.kv_metrics for o in expected]
    assert packed.kv_cache_stats() == reference.kv_cache_stats()
    scenario.expect_oracle(packed, got, exact=workload.oracle_exact)
