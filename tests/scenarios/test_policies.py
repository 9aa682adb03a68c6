"""Proves reuse is off, with a reason, where it cannot be right: star attention.

The star backend reuses nothing (reusedBlocks == 0) and logs why; with reuse off every
prompt block is missed and warm outputs still equal cold. (Hybrid models reuse at
recurrent-state snapshots: test_hybrid.py; one whose state cannot be snapshotted keeps
reuse off with a reason, tested there too.)
"""

from __future__ import annotations

import logging

import pytest

from tests.scenarios.support import TORCH, BackendSpec, EngineFactory, ScenarioRun, prompts_of

STAR = BackendSpec("star", "cpu", TORCH.dtype, TORCH.atol)
PROMPT_LENGTHS = [5, 16, 17, 30]


@pytest.mark.parametrize("reuse", [pytest.param(None, id="auto"),
                                   pytest.param(True, id="explicit")])
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (1, 4, 16)])
def test_star_backend_reuses_nothing_and_says_why(make_engine: EngineFactory,
                                                  scenario: ScenarioRun,
                                                  caplog: pytest.LogCaptureFixture,
                                                  B: int, reuse: bool | None) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcache.engine.engine"):
        engine = make_engine(B, backend=STAR, reuse=reuse)
    assert "block reuse disabled: attention backend 'star' does not support block reuse" \
        in caplog.text
    assert engine.reuse_disabled_reason is not None
    assert not engine.cache_config.block_reuse
    prompts = prompts_of(B, PROMPT_LENGTHS)
    run = scenario.cold_warm(engine, prompts, 3, STAR, seed=B)
    stats = engine.kv_cache_stats()
    assert stats.reused_blocks == 0
    assert stats.missed_blocks == 2 * sum(-(-n // B) for n in PROMPT_LENGTHS)
    assert [o.num_cached_tokens for o in run.warm] == [0] * len(prompts)
    assert [engine.manager.probe_reuse(p) for p in prompts] == [0] * len(prompts)


@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_reuse_switched_off_misses_every_block(make_engine: EngineFactory,
                                               scenario: ScenarioRun, B: int) -> None:
    engine = make_engine(B, reuse=False)
    prompts = prompts_of(B, PROMPT_LENGTHS)
    run = scenario.cold_warm(engine, prompts, 3, TORCH, seed=B)
    assert [o.num_cached_tokens for o in run.warm] == [0] * len(prompts)
    assert engine.kv_cache_stats().cached_num_blocks == 0
    assert engine.reuse_disabled_reason is None  # off by request, nothing to explain
