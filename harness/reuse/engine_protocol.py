"""What a reuse scenario needs from an engine: the small protocol any engine can implement.

Scenarios, the reuse assertions (`harness.reuse.assertions`) and the oracle (`harness.oracle.model`) reach an
engine only through `EngineUnderTest`, so the same suites can drive another engine: wrap
it in an adapter with these four members and its reuse is checked against the same
oracle. Names of KV counters follow TensorRT-LLM (`reusedBlocks`, `missedBlocks`, ...);
snake_case spellings are accepted too (see `harness.reuse.assertions.canonical_name`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SupportsAsDict(Protocol):
    """A stats object (e.g. `kvcache.KvCacheStats`) that lists its counters by name."""

    def as_dict(self) -> Mapping[str, int | float]:
        """Counter name -> value."""
        ...


StatsLike = SupportsAsDict | Mapping[str, Any]


class GenerationResult(Protocol):
    """One request's result, in the order of the prompts given to `generate`."""

    @property
    def request_id(self) -> Hashable:
        """The request's id: its sequence's `seq_id` in `admission_log()` (joins results
        to the log)."""
        ...

    @property
    def token_ids(self) -> Sequence[int]:
        """The generated tokens only (the prompt excluded)."""
        ...

    @property
    def logits(self) -> Any | None:
        """Logits of the generated positions, `[n, vocab]` tensor or array, if kept."""
        ...

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the cache (the reused tokens)."""
        ...

    @property
    def kv_metrics(self) -> Mapping[str, int | float] | SupportsAsDict | None:
        """KV counters of the request's first admission (reusedBlocks or numReusedBlocks,
        missedBlocks, ...), or None when the engine keeps none."""
        ...


@runtime_checkable
class EngineUnderTest(Protocol):
    """An engine whose block reuse the harness checks.

    `generate` runs prompts to completion and mutates the cache; the other members only
    read. `admission_log()` lists, since the engine was built, every cache operation in
    the order the cache saw it, as mappings with keys kind ("admit" | "commit" |
    "append" | "free", and optionally "copy"), seq_id (the cache's name for the
    request's sequence: a result's request_id), tokens (admit: the prompt; append:
    the new tokens), num_tokens (commit: tokens whose KV is now valid, counted from the
    sequence's start) and scope (None, or a hashable key such as (salt, lora_id));
    replaying it through `harness.oracle.model.replay` predicts reuse under any batching
    or chunking. A log that also records block_ids (admit: the sequence's blocks, with
    num_tokens the tokens reused; append: the blocks allocated; commit: the blocks after
    a switch to equal cached blocks; copy: (src, dst) of each copy applied before the
    next forward pass, num_tokens slots) can be replayed by the provenance oracle
    (`harness.oracle.ShadowStore`) too. `kv_cache_stats()` is cumulative since the
    engine was built.
    """

    @property
    def cache_config(self) -> Mapping[str, Any] | Any:
        """Effective settings: tokens_per_block (int), enable_block_reuse,
        enable_partial_reuse, copy_on_partial_reuse (resolved bools, never "auto"), and
        for a bounded oracle the pool sizes max_num_blocks and host_cache_blocks (0: no
        host tier). A kvcache.KvCacheConfig is accepted too (both are read by
        `harness.oracle.types.OracleConfig.from_cache_config`)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 scopes: Sequence[Any] | None = None) -> Sequence[GenerationResult]:
        """Run `prompts` (scope i for prompt i, or none) and return one result each."""
        ...

    def kv_cache_stats(self) -> StatsLike:
        """Cumulative cache counters with TensorRT-LLM names (or an object with as_dict)."""
        ...

    def admission_log(self) -> Sequence[Mapping[str, Any]]:
        """Every admit/commit/append/free (and copy) so far, in the order the cache saw
        them."""
        ...
