"""Proves reuse is off, with a reason, where it cannot be right: star attention, hybrid models.

The star backend reuses nothing (reusedBlocks == 0) and logs why; the hybrid (recurrent)
model turns reuse off under auto and rejects an explicit enable; with reuse off every
prompt block is missed and warm outputs still equal cold.
"""

from __future__ import annotations

import logging

import pytest

from kvcache import Engine, KvCacheConfig
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


@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (1, 4, 16)])
def test_hybrid_model_auto_disables_reuse(make_engine: EngineFactory, scenario: ScenarioRun,
                                          caplog: pytest.LogCaptureFixture, B: int) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcache.engine.engine"):
        engine = make_engine(B, preset="hybrid-tiny")
    assert "recurrent" in (engine.reuse_disabled_reason or "")
    assert "block reuse disabled" in caplog.text
    prompts = prompts_of(B, PROMPT_LENGTHS)
    scenario.cold_warm(engine, prompts, 3, TORCH, seed=B)
    assert engine.kv_cache_stats().reused_blocks == 0
    assert engine.kv_cache_stats().cached_num_blocks == 0


def test_hybrid_model_rejects_explicit_reuse(make_engine: EngineFactory) -> None:
    with pytest.raises(ValueError, match=r"enable_block_reuse=True is unsupported for a model "
                                         r"with recurrent layers \(layers \[1\]\)"):
        make_engine(4, preset="hybrid-tiny", reuse=True)
    with pytest.raises(ValueError, match="enable_block_reuse=True is unsupported"):
        Engine("hybrid-tiny", KvCacheConfig(tokens_per_block=4, max_num_blocks=64,
                                            enable_block_reuse=True))


@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_reuse_switched_off_misses_every_block(make_engine: EngineFactory,
                                               scenario: ScenarioRun, B: int) -> None:
    engine = make_engine(B, reuse=False)
    prompts = prompts_of(B, PROMPT_LENGTHS)
    run = scenario.cold_warm(engine, prompts, 3, TORCH, seed=B)
    assert [o.num_cached_tokens for o in run.warm] == [0] * len(prompts)
    assert engine.kv_cache_stats().cached_num_blocks == 0
    assert engine.reuse_disabled_reason is None  # off by request, nothing to explain
