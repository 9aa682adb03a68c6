"""Adapters with one deliberate fault each, over kvcache's real manager: what every
oracle of the judge must catch (the judge's own tests, and the shrinker's)."""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.protocol import Admission, CacheOptions, Scope, Stats


class SaltIsLora(KvcacheCache):
    """Keys a salt "1" as LoRA id 1, as SGLang before 0.5.22 joined them into one
    string: the two scopes share KV."""

    def _scope(self, scope: Scope | None) -> Any:
        if scope is not None and scope.salt is not None and scope.salt.isdigit() \
                and not scope.has_lora:
            return self._kvcache.ReuseScope(None, int(scope.salt))
        return super()._scope(scope)


class MissesAfterAnEviction(KvcacheCache):
    """Once the cache has published a BlockRemoved, an admission looks its prompt up in a
    scope of its own (logged under the request's): it reuses nothing that is cached, a
    shortfall only a count oracle that followed the eviction can call."""

    evicted = False

    def take_events(self) -> list[dict[str, Any]]:
        events = super().take_events()
        self.evicted = self.evicted or any(e["type"] == "BlockRemoved" for e in events)
        return events

    def _scope(self, scope: Scope | None) -> Any:
        if self.evicted:
            return self._kvcache.ReuseScope("a scope of its own", None)
        return super()._scope(scope)


class CountsRefusals(KvcacheCache):
    """A refused admission still bumps a counter, as vLLM up to 0.26 counted lookups."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True,
                 options: CacheOptions | None = None) -> None:
        super().__init__(num_blocks, block_size, record=record, options=options)
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


class KeysLoraByName(KvcacheCache):
    """Keys a LoRA on its name alone, as vLLM 0.11.1-0.30.0 do: a name re-pointed at
    another adapter reads the first adapter's KV."""

    def _scope(self, scope: Scope | None) -> Any:
        if scope is not None and scope.has_lora:
            ids = self.__dict__.setdefault("_name_ids", {})  # name -> the id it keys on
            lora_id = ids.setdefault(scope.lora_name, len(ids))
            return self._kvcache.ReuseScope(scope.salt, lora_id)
        return super()._scope(scope)


class LoraOutOfEventHashes(KvcacheCache):
    """Publishes event hashes that chain a block's tokens and salt only, with no LoRA id,
    as SGLang 0.5.22 on do in their default format: two LoRAs' copies of one prompt
    publish one hash (the cache itself keeps them apart)."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True,
                 options: CacheOptions | None = None) -> None:
        super().__init__(num_blocks, block_size, record=record, options=options)
        self._renamed: dict[str, str] = {}  # kvcache's hash -> the published one

    @staticmethod
    def _salted(parent: str | None, tokens: Sequence[int], salt: Any) -> str:
        h = hashlib.blake2b(json.dumps([parent, list(tokens), salt]).encode(), digest_size=8)
        return str(int.from_bytes(h.digest(), "little"))

    def take_events(self) -> list[dict[str, Any]]:
        out = []
        for event in super().take_events():
            if event["type"] == "BlockStored":
                old = event["parent_block_hash"]
                parent = None if old is None else self._renamed[old]
                hashes, B = [], event["block_size"]
                for i, h in enumerate(event["block_hashes"]):
                    tokens = event["token_ids"][i * B:(i + 1) * B]
                    hashes.append(self._renamed.setdefault(
                        h, self._salted(hashes[-1] if hashes else parent, tokens, event["salt"])))
                event = {**event, "block_hashes": hashes, "parent_block_hash": parent,
                         "lora_id": None}
            elif "block_hashes" in event:
                event = {**event, "block_hashes": [self._renamed[h]
                                                   for h in event["block_hashes"]]}
            out.append(event)
        return out

    def cached_hashes(self) -> list[str]:
        out: list[str] = []
        last: dict[int, str | None] = {}  # node id -> the published hash of its last block
        B = self.manager.state.config.tokens_per_block
        for key, node in self.manager.state.tree.walk():  # parents before children
            parent = last.get(id(node.parent))
            if node.host:
                continue
            tokens = array("I", node.key)  # the tree's key bytes
            for i in range(len(node.blocks)):
                parent = self._salted(parent, tokens[i * B:(i + 1) * B].tolist(),
                                      None if key is None else key[0])
                out.append(parent)
            last[id(node)] = parent
        return out


class LoraOutOfEventHashesKnown(LoraOutOfEventHashes):
    """The same, with a contract that names it a known limitation, as SGLang's does."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True,
                 options: CacheOptions | None = None) -> None:
        super().__init__(num_blocks, block_size, record=record, options=options)
        self._contract = replace(self._contract, limitations=(
            ("scope_in_event_hash", "lora", "https://example.invalid/rfc"),))


class LogsLiveTokens(KvcacheCache):
    """Logs each admission's tokens as the sequence's own list, which its appends then
    extend (as SGLang's adapter did): read after a later append, the admission seems to
    have admitted the appended tokens too."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True,
                 options: CacheOptions | None = None) -> None:
        super().__init__(num_blocks, block_size, record=record, options=options)
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

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True,
                 options: CacheOptions | None = None) -> None:
        super().__init__(num_blocks, block_size, record=record, options=options)
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
            self._seen = len(self.manager.state.events or ())
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

    def preempt(self, seq_id: Hashable) -> None:
        self._planted("preempt", lambda: super(RaisesAt, self).preempt(seq_id))

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
