"""Adapters with one deliberate fault each, over kvcache's real manager: what every
oracle of the judge must catch (the judge's own tests, and the shrinker's)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.protocol import Admission, Scope, Stats


class SaltIsLora(KvcacheCache):
    """Keys a salt "1" as LoRA id 1, as SGLang before 0.5.22 joined them into one
    string: the two scopes share KV."""

    def _scope(self, scope: Scope | None) -> Any:
        if scope is not None and scope.salt is not None and scope.salt.isdigit() \
                and not scope.has_lora:
            return self._kvcache.ReuseScope(None, int(scope.salt))
        return super()._scope(scope)


class CountsRefusals(KvcacheCache):
    """A refused admission still bumps a counter, as vLLM up to 0.26 counted lookups."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True) -> None:
        super().__init__(num_blocks, block_size, record=record)
        self.lookups = 0

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        self.lookups += 1
        return super().admit(seq_id, tokens, scope, first_chunk)

    def stats(self) -> Stats:
        got = super().stats()
        return Stats({**got.engine, "lookups": self.lookups}, got.harness)


class RefusesEarly(KvcacheCache):
    """Refuses any admission once half the pool is in use, although blocks are free."""

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        if 2 * self.used_blocks() >= self.manager.state.config.max_num_blocks:
            return None
        return super().admit(seq_id, tokens, scope, first_chunk)


class SilentStores(KvcacheCache):
    """Publishes no BlockStored: a router never learns what the cache holds."""

    def take_events(self) -> list[dict[str, Any]]:
        return [e for e in super().take_events() if e["type"] != "BlockStored"]


class RaisesOnAppend(KvcacheCache):
    """The engine raises inside a decode step."""

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        raise AttributeError("'LoRARequest' object has no attribute 'id'")


class LeaksOnFree(KvcacheCache):
    """Forgets to free sequences: their blocks stay held after the request is gone."""

    def free(self, seq_id: Hashable) -> None:
        self._scopes.pop(seq_id, None)
        events = self.manager.state.events
        events.append(self._kvcache.CacheEvent("free", seq_id))  # type: ignore[union-attr]


class LogsWrongIds(KvcacheCache):
    """Logs the first block of an admission as some other block: provenance must see
    a read of KV the request never wrote."""

    def take_log(self) -> list[dict[str, Any]]:
        out = super().take_log()
        for event in out:
            if event["kind"] == "admit" and event["num_tokens"] and event["block_ids"]:
                event["block_ids"][0] = max(event["block_ids"]) + 1
        return out
