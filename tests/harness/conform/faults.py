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

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True) -> None:
        super().__init__(num_blocks, block_size, record=record)
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
        B = self.manager.config.tokens_per_block
        for key, node in self.manager.tree.walk():  # parents before children
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

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True) -> None:
        super().__init__(num_blocks, block_size, record=record)
        self._contract = replace(self._contract, limitations=(
            ("scope_in_event_hash", "lora", "https://example.invalid/rfc"),))
