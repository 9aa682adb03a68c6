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
        if 2 * self.used_blocks() >= self.manager.config.max_num_blocks:
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
        self.manager.events.append(self._kvcache.CacheEvent("free", seq_id))  # type: ignore[union-attr]


class LogsWrongIds(KvcacheCache):
    """Logs the first block of an admission as some other block: provenance must see
    a read of KV the request never wrote."""

    def take_log(self) -> list[dict[str, Any]]:
        out = super().take_log()
        for event in out:
            if event["kind"] == "admit" and event["num_tokens"] and event["block_ids"]:
                event["block_ids"][0] = max(event["block_ids"]) + 1
        return out


class LogsLiveTokens(KvcacheCache):
    """Logs each admission's tokens as the sequence's own list, which its appends then
    extend (as SGLang's adapter did): read after a later append, the admission seems to
    have admitted the appended tokens too."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True) -> None:
        super().__init__(num_blocks, block_size, record=record)
        self.tokens: dict[Hashable, list[int]] = {}

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        got = super().admit(seq_id, tokens, scope, first_chunk)
        if got is not None:
            self.tokens[seq_id] = list(tokens)
        return got

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        got = super().append(seq_id, tokens)
        if got is not None:
            self.tokens[seq_id].extend(tokens)
        return got

    def take_log(self) -> list[dict[str, Any]]:
        out = super().take_log()
        for event in out:
            if event["kind"] == "admit":
                event["tokens"] = self.tokens[event["seq_id"]]
        return out


class RaisesAt(KvcacheCache):
    """kvcache, but the second call of the op `kind` raises, `when`: "before" the
    manager is called (nothing changed); "logged", once it did its work (the cache
    changed and its log says so, while the session counts the op as failed and still
    drives the sequence); "unlogged", the same but its log of the op is lost (as where an
    adapter writes its log after several engine calls, and a later one raised).
    Subclass it with both set (`raises_at`)."""

    kind = ""
    when = "before"

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True) -> None:
        super().__init__(num_blocks, block_size, record=record)
        self.calls = 0

    def _planted(self, kind: str, call: Any) -> Any:
        if kind != self.kind:
            return call()
        self.calls += 1
        if self.calls != 2:
            return call()
        if self.when == "before":
            raise RuntimeError(f"planted: {kind} raised before it began")
        call()
        if self.when == "unlogged":
            self._seen = len(self.manager.events or ())
        raise RuntimeError(f"planted: {kind} raised after it was done ({self.when})")

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        return self._planted("admit", lambda: super(RaisesAt, self).admit(
            seq_id, tokens, scope, first_chunk))

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        return self._planted("reserve", lambda: super(RaisesAt, self).reserve(
            seq_id, num_tokens))

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        self._planted("commit", lambda: super(RaisesAt, self).commit(seq_id, num_tokens))

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        return self._planted("append", lambda: super(RaisesAt, self).append(seq_id, tokens))

    def free(self, seq_id: Hashable) -> None:
        self._planted("free", lambda: super(RaisesAt, self).free(seq_id))

    def evict(self, num_blocks: int) -> int:
        return self._planted("evict", lambda: super(RaisesAt, self).evict(num_blocks))


def raises_at(kind: str, when: str) -> type[RaisesAt]:
    """`RaisesAt` planted at `kind`, raising `when` ("before", "logged", "unlogged")."""
    return type(f"RaisesAt_{kind}_{when}", (RaisesAt,), {"kind": kind, "when": when})


class LeaksWhenAlone(LeaksOnFree):
    """Freeing the only live sequence leaves its blocks held: a leak that a busy op list
    hides and a short one shows."""

    def free(self, seq_id: Hashable) -> None:
        if len(self.manager.sequences) > 1:
            KvcacheCache.free(self, seq_id)
        else:
            super().free(seq_id)


class RefusesEarlyLeaksWhenAlone(RefusesEarly, LeaksWhenAlone):
    """Two capacity faults: unfair refusals, and a leak only short op lists show (what
    a shrinker holding only to the oracle drifts to)."""


class StoresAsRoots(KvcacheCache):
    """Publishes every BlockStored with no parent, as a publisher that chains parents
    across the blocks it stores, never from those cached before them, does: a block
    stored after cached ones hangs from the root."""

    def take_events(self) -> list[dict[str, Any]]:
        out = super().take_events()
        for event in out:
            if event["type"] == "BlockStored":
                event["parent_block_hash"] = None
        return out


class StoresUnderUnknownParent(KvcacheCache):
    """Publishes a BlockStored's parent as a hash it never published."""

    def take_events(self) -> list[dict[str, Any]]:
        out = super().take_events()
        for event in out:
            if event["type"] == "BlockStored" and event["parent_block_hash"] is not None:
                event["parent_block_hash"] = "404"
        return out
