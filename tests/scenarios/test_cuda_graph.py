"""Proves padded (CUDA-graph) decode equals eager, unpadded decode for reused and fresh sequences.

Replayed graphs on GPU, the same padded path without capture on CPU, while batch sizes
shrink and page counts grow between steps.
"""

from __future__ import annotations

import pytest

from kvcache import Engine, GenerationOutput
from tests.scenarios.support import (
    CPU_BACKENDS,
    FI_FP16,
    MODES,
    BackendSpec,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    prompts_of,
)

GRAPH_SIZES = (1, 2, 4, 8)


def run_mixed(engine: Engine, B: int, force: list[list[int]] | None = None
              ) -> list[GenerationOutput]:
    """Warm two prompts, then decode them beside three fresh ones with different lengths
    to go: the batch shrinks 5 -> 3 -> 1 (padded to 8, 4, 1) and every sequence crosses
    block (page) boundaries while decoding. Returns the second phase's outputs."""
    prompts = prompts_of(B, [2 * B + 1, 3 * B - 1, B + 2, 5, 2 * B])
    news = [B + 3, 2 * B + 2, B + 3, 2 * B + 2, 3 * B]
    engine.generate(prompts[:2], 2)
    rids = [engine.add_request(p, n, force_tokens=force[i] if force else None)
            for i, (p, n) in enumerate(zip(prompts, news, strict=True))]
    done: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    return [done[r] for r in rids]


@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (2, 4, 16)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_padded_decode_equals_unpadded(make_engine: EngineFactory, scenario: ScenarioRun,
                                       backend: BackendSpec, mode: ReuseMode, B: int) -> None:
    plain = make_engine(B, backend=backend, mode=mode)
    expected = run_mixed(plain, B)
    padded = make_engine(B, backend=backend, mode=mode, pad_decode=True,
                         graph_batch_sizes=GRAPH_SIZES)
    force = None if backend.exact else [list(o.token_ids) for o in expected]
    got = run_mixed(padded, B, force)
    assert_same_outputs(expected, got, backend, "padded vs unpadded decode")
    assert [o.num_cached_tokens for o in got[:2]] == [2 * B, 3 * B - 2 if mode.partial else 2 * B]
    # padding rows are not computed tokens: both engines ran exactly the same work
    assert padded.num_computed_tokens == plain.num_computed_tokens
    scenario.expect_oracle(padded, got, seed=B)


@pytest.mark.gpu
@pytest.mark.flashinfer
@pytest.mark.cuda_graph
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_graph_replay_equals_eager_with_reuse(make_engine: EngineFactory,
                                              scenario: ScenarioRun, B: int) -> None:
    eager = make_engine(B, backend=FI_FP16)
    expected = run_mixed(eager, B)
    graphed = make_engine(B, backend=FI_FP16, cuda_graph=True, graph_batch_sizes=GRAPH_SIZES)
    got = run_mixed(graphed, B, [list(o.token_ids) for o in expected])
    assert_same_outputs(expected, got, FI_FP16, "graph replay vs eager decode")
    assert graphed.graphs is not None and graphed.graphs.sizes == frozenset(GRAPH_SIZES)
    scenario.expect_oracle(graphed, got, seed=B)
