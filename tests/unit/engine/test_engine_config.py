"""EngineConfig: the keywords are sugar for it, its dict form round-trips, values are
normalised, and the engine, from_pretrained included, runs what it says."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcache import Engine, EngineConfig, KvCacheConfig
from kvcache.model import Transformer, get_preset, save_pretrained

PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9]]


def cache() -> KvCacheConfig:
    return KvCacheConfig(tokens_per_block=4, max_num_blocks=32)


def test_keywords_are_sugar_for_an_engine_config() -> None:
    by_keywords = Engine("tiny", cache(), max_num_tokens=8, max_batch_size=3)
    by_config = Engine("tiny", cache(), EngineConfig(max_num_tokens=8, max_batch_size=3))
    overridden = Engine("tiny", cache(), EngineConfig(max_num_tokens=64, share_prefixes=False),
                        max_num_tokens=8, max_batch_size=3, share_prefixes=True)
    assert by_keywords.config == by_config.config == overridden.config
    assert by_keywords.config == EngineConfig(max_num_tokens=8, max_batch_size=3)
    assert by_keywords.scheduler.max_num_tokens == 8 and by_keywords.table.max_slots == 3
    outs = [e.generate(PROMPTS, 3) for e in (by_keywords, by_config, overridden)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]] \
        == [o.token_ids for o in outs[2]]
    assert by_keywords.num_steps == by_config.num_steps == overridden.num_steps


def test_the_dict_form_round_trips() -> None:
    config = EngineConfig(attn_backend="star", max_num_tokens=7, graph_batch_sizes=[8, 2],
                          pad_decode=True, dtype="bfloat16", device=torch.device("cpu"),
                          backend_options={"anything": 1})
    assert config.graph_batch_sizes == (2, 8) and config.dtype is torch.bfloat16
    assert config.device == "cpu" and config.pads_decode
    data = config.as_dict()
    assert data["dtype"] == "bfloat16" and data["graph_batch_sizes"] == [2, 8]
    assert json.loads(json.dumps(data)) == data  # JSON-ready: the backend is a name
    assert EngineConfig.from_dict(data) == config
    assert EngineConfig.from_dict({}) == EngineConfig()


def test_an_older_record_s_null_backend_options_are_none() -> None:
    # Records written before EngineConfig kept Engine's default, backend_options=None.
    assert EngineConfig.from_dict({"backend_options": None}).backend_options == {}


def test_values_are_normalised_and_the_options_copied() -> None:
    options = {"kernel_family": "fa2"}
    config = EngineConfig(max_num_tokens=np.int64(9), seed=np.uint8(3), backend_options=options)
    options["kernel_family"] = "fa3"
    assert type(config.max_num_tokens) is int and type(config.seed) is int
    assert config.backend_options == {"kernel_family": "fa2"}
    with pytest.raises(FrozenInstanceError):
        config.max_num_tokens = 3  # type: ignore[misc]
    assert hash(config) == hash(EngineConfig(max_num_tokens=9, seed=3,
                                             backend_options={"kernel_family": "fa2"}))


def test_the_engine_runs_its_config(tmp_path: Path) -> None:
    config = EngineConfig(dtype=torch.float64, layout="HND", page_size=2, pad_decode=True,
                          graph_batch_sizes=(4,), seed=5)
    engine = Engine("tiny", cache(), config)
    assert engine.storage.dtype is torch.float64 and engine.storage.layout == "HND"
    assert engine.backend.page_size == 2
    assert engine.runner.pad_sizes == (4,) and engine.batch.capacity >= 4
    save_pretrained(Transformer(get_preset("tiny"), seed=5), tmp_path)
    loaded = Engine.from_pretrained(tmp_path, cache(), config, max_batch_size=2)
    assert loaded.config == EngineConfig(**{**config.as_dict(), "max_batch_size": 2})
    assert next(loaded.model.parameters()).dtype is torch.float64
    assert [o.token_ids for o in loaded.generate(PROMPTS, 3)] == \
        [o.token_ids for o in engine.generate(PROMPTS, 3)]  # the same weights (seed 5)
