"""Proves manager blocks read as 2, 4 or 8 kernel pages (NHD, HND) equal direct paging.

Cold, warm and through partial-reuse copies, with exactly the oracle's reuse.
"""

from __future__ import annotations

import pytest

from harness.workloads import shared_system_prompt
from kvcache import Engine, GenerationOutput
from tests.scenarios.support import (
    ALL_BACKENDS,
    VOCAB,
    BackendSpec,
    EngineFactory,
    ScenarioRun,
    assert_same_outputs,
    forced,
)

B = 16
NEW_TOKENS = 3


def run(engine: Engine, prompts: list[list[int]], force: list[list[int]] | None
        ) -> list[GenerationOutput]:
    """The first prompt alone, the rest beside each other (partial copies of its blocks),
    then everything again warm; `force[i]` teacher-forces output i."""
    outs: list[GenerationOutput] = []
    for batch in (prompts[:1], prompts[1:], prompts):
        start = len(outs)
        outs += engine.generate(batch, NEW_TOKENS,
                                force_tokens=force[start:start + len(batch)] if force else None)
    return outs


@pytest.mark.parametrize("page_size", [pytest.param(P, id=f"{B // P}pages") for P in (8, 4, 2)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_repaged_blocks_equal_direct_paging(make_engine: EngineFactory, scenario: ScenarioRun,
                                            backend: BackendSpec, layout: str,
                                            page_size: int) -> None:
    prompts = shared_system_prompt(4, 21, 20, vocab=VOCAB, seed=page_size)
    direct = make_engine(B, backend=backend, layout=layout)
    expected = run(direct, prompts, None)
    repaged = make_engine(B, backend=backend, layout=layout, page_size=page_size)
    assert repaged.backend.page_size == page_size
    force = None if backend.exact else [list(o.token_ids) for o in expected]
    got = run(repaged, prompts, force)
    assert_same_outputs(expected, got, backend, f"{B // page_size} pages a block vs one")
    assert repaged.kv_cache_stats().copied_blocks > 0  # copies ran through the repaged view
    scenario.expect_oracle(repaged, got, seed=page_size)
    scenario.expect_oracle(direct, expected, seed=page_size)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_repaged_cold_equals_a_run_without_reuse(make_engine: EngineFactory,
                                                 backend: BackendSpec) -> None:
    prompts = shared_system_prompt(3, 21, 9, vocab=VOCAB, seed=1)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend)
    repaged = make_engine(B, backend=backend, layout="HND", page_size=4)
    got = repaged.generate(prompts, NEW_TOKENS, force_tokens=forced(reference, backend))
    assert_same_outputs(reference, got, backend, "repaged vs reference")
