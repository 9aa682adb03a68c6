"""Adapters from concrete engines to `EngineUnderTest`; kvcache's Engine is the first.

Another engine joins the same scenarios, oracle and reuse assertions by writing one such
class: effective cache settings, generate, cumulative stats and the admission log.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.oracle.types import OracleConfig

if TYPE_CHECKING:
    from kvcache import Engine, KvCacheManager, ReuseScope


@dataclass(frozen=True)
class Result:
    """One request's result in the protocol's terms."""

    request_id: Hashable
    token_ids: Sequence[int]
    logits: Any | None
    num_cached_tokens: int
    kv_metrics: Mapping[str, int | float]


class KvcacheEngineAdapter:
    """`EngineUnderTest` over `kvcache.Engine`; also a cache owner for the leak check."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def cache_manager(self) -> KvCacheManager:
        """The engine's manager (the harness plugin checks it for leaks after a test)."""
        return self.engine.manager

    @property
    def cache_config(self) -> Mapping[str, Any]:
        """The effective settings, every flag resolved, and the pool sizes (max_num_blocks,
        host_cache_blocks)."""
        c = self.engine.cache_config
        effective = OracleConfig.from_cache_config(c, "engine.cache_config")
        return {**effective.as_dict(), "max_num_blocks": c.max_num_blocks,
                "host_cache_blocks": c.host_cache_blocks}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 scopes: Sequence[ReuseScope | None] | None = None,
                 **options: Any) -> list[Result]:
        """Run prompts to completion; `options` go to `Engine.generate`."""
        outs = self.engine.generate(prompts, max_new_tokens, scopes, **options)
        return [Result(o.request_id, o.token_ids, o.logits, o.num_cached_tokens,
                       o.kv_metrics.as_dict() if o.kv_metrics is not None else {})
                for o in outs]

    def kv_cache_stats(self) -> Mapping[str, int | float]:
        """Cumulative stats, TensorRT-LLM names."""
        return self.engine.kv_cache_stats().as_dict()

    def admission_log(self) -> list[dict[str, Any]]:
        """The cache's operations in order."""
        return self.engine.admission_log()
