"""Fixtures of the scenario suites: an engine factory over shared models, one torch thread,
and `scenario`, which checks runs against the oracle and records them in the reuse report."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from kvcache import Engine, GenerationOutput, KvCacheConfig, KVCacheManager
from kvcache.model import Transformer, get_preset

from .support import TORCH, BackendSpec, ReuseMode, ScenarioRun

POOL_TOKENS = 2048  # default pool: far more than any scenario holds, so nothing is evicted


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread for the test (the tiny model gains nothing from more, and on a
    busy 2-core runner spinning threads slows every step many times over)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Models:
    """Presets built once per (name, device, dtype) with seed 0; engines share them (a
    model holds no per-request state). Mutates only its own cache."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, str, torch.dtype], Transformer] = {}

    def get(self, preset: str, device: str, dtype: torch.dtype) -> Transformer:
        """The shared model for this preset, device and dtype."""
        key = (preset, device, dtype)
        if key not in self._built:
            model = Transformer(get_preset(preset), seed=0)
            self._built[key] = model.to(device=device, dtype=dtype).eval()
        return self._built[key]


@pytest.fixture(scope="session")
def models() -> Models:
    """The session's shared models."""
    return Models()


class EngineFactory:
    """Builds engines for one test; the harness checks `cache_owners()` for leaks after it."""

    def __init__(self, models: Models) -> None:
        self.models = models
        self.created: list[Engine] = []

    def __call__(self, tokens_per_block: int, *, backend: BackendSpec = TORCH,
                 mode: ReuseMode | None = None, reuse: bool | None = None,
                 max_num_blocks: int | None = None, preset: str = "tiny",
                 **engine_options: Any) -> Engine:
        """A fresh engine. `mode` sets the partial-reuse flags (None: the defaults);
        `reuse` is enable_block_reuse; `max_num_blocks` defaults to POOL_TOKENS worth;
        `engine_options` go to `Engine` (max_num_tokens, page_size, ...)."""
        blocks = max_num_blocks or -(-POOL_TOKENS // tokens_per_block)
        cfg = KvCacheConfig(
            tokens_per_block=tokens_per_block, max_num_blocks=blocks, enable_block_reuse=reuse,
            enable_partial_reuse=None if mode is None else mode.partial,
            copy_on_partial_reuse=mode.copy if mode is not None and mode.partial else None)
        model = self.models.get(preset, backend.device, backend.dtype)
        engine = Engine(model, cfg, attn_backend=backend.attn, device=backend.device,
                        dtype=backend.dtype, **engine_options)
        self.created.append(engine)
        return engine

    def cold_reference(self, tokens_per_block: int, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int, *, backend: BackendSpec = TORCH,
                       preset: str = "tiny") -> list[GenerationOutput]:
        """Outputs of `prompts` computed with nothing reused: a fresh engine admits them
        all in its first step, before anything is committed (asserted, so the reference
        stays cold whatever the reuse flags do)."""
        total = sum(len(p) for p in prompts) + len(prompts) * max_new_tokens
        engine = self(tokens_per_block, backend=backend, reuse=False, preset=preset,
                      max_num_tokens=max(total, 1), max_batch_size=len(prompts),
                      max_num_blocks=max(total, 1), enable_chunked_prefill=False)
        outs = engine.generate(prompts, max_new_tokens)
        assert [o.num_cached_tokens for o in outs] == [0] * len(prompts), "reference reused"
        return outs

    def cache_owners(self) -> list[KVCacheManager]:
        """Every engine's manager (the plugin's leak check reads this)."""
        return [e.manager for e in self.created]


@pytest.fixture
def make_engine(models: Models) -> EngineFactory:
    """A factory of engines whose caches must be clean after the test."""
    return EngineFactory(models)


@pytest.fixture
def scenario(request: pytest.FixtureRequest, reuse_report: Any) -> ScenarioRun:
    """Oracle checks and cold/warm runs for this test, recorded under its family's name
    (the module name without `test_`)."""
    callspec = getattr(request.node, "callspec", None)
    params = {k: str(v) for k, v in callspec.params.items()} if callspec else {}
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    return ScenarioRun(name, request.node.nodeid, params, reuse_report)
