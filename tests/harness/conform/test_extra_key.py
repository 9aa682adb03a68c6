"""A caller's extra key (SGLang's request `extra_key`): in the scope and a contract's
key, and its family, which must find an engine that joins the extra key and the LoRA id
into one string (SGLang's Req.__init__, sgl-project/sglang#24638) and pass one that
keeps them apart. kvcache itself keys on no extra key and skips the family."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from harness.conform.adapters import kvcache
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.adapters.kvcache import contract as kvcache_contract
from harness.conform.adapters.sglang import contract as sglang_contract
from harness.conform.controller.checks import check_named
from harness.conform.controller.runner import run_check
from harness.conform.controller.targets import LocalTarget
from harness.conform.protocol import Scope, lora_id_text

FAMILY = check_named("extra_key_isolation")


class KeepsExtraKeyApart(KvcacheCache):
    """kvcache keyed on a caller extra key too, apart from the salt and the LoRA (its
    salt is the pair): the reference semantics for an extra key."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True) -> None:
        super().__init__(num_blocks, block_size, record=record)
        self._contract = replace(self._contract, scope_kinds=("salt", "lora", "extra_key"))

    def _scope(self, scope: Scope | None) -> Any:
        if scope is None:
            return None
        return self._kvcache.ReuseScope(json.dumps([scope.salt, scope.extra_key]),
                                        scope.lora_id)


class JoinsExtraKeyAndLora(KeepsExtraKeyApart):
    """The fault: `extra_key = (extra_key or "") + lora_id`, one string."""

    def _scope(self, scope: Scope | None) -> Any:
        if scope is None:
            return None
        key = scope.extra_key
        if scope.lora_id is not None:
            key = (key or "") + lora_id_text(scope.lora_id)
        return self._kvcache.ReuseScope(json.dumps([scope.salt, key]), None)


def test_an_engine_that_keeps_the_extra_key_apart_passes() -> None:
    result = run_check(LocalTarget(kvcache.load(KeepsExtraKeyApart)), FAMILY)
    assert result.status == "pass", result.message


def test_an_extra_key_equal_to_a_loras_id_reaching_its_kv_is_found_and_shrunk() -> None:
    result = run_check(LocalTarget(kvcache.load(JoinsExtraKeyAndLora)), FAMILY)
    assert (result.status, result.oracle) == ("fail", "count")
    # shrunk: the LoRA's prompt, then two of its tokens under an extra key = its id
    assert result.message.startswith(f"admit(K1, tokens [1, 2], extra_key="
                                     f"{lora_id_text(1)!r}) reused 1 tokens; the count "
                                     "oracle predicts 0")
    assert [op["kind"] for op in result.ops] == ["admit", "commit", "admit"]
    assert result.ops[0]["scope"] == {"lora_name": "a", "lora_id": 1,
                                      "lora_path": "/loras/1"}
    assert any("provenance" in also for also in result.also)


def test_kvcache_keys_on_no_extra_key_and_skips_the_family() -> None:
    result = run_check(LocalTarget(kvcache.load()), FAMILY)
    assert result.status == "skip"
    assert result.message == "the engine's cache key takes no caller extra key " \
                             "(Contract.scope_kinds)"


def test_a_scope_carries_an_extra_key_through_json_and_into_the_keys_that_take_it() -> None:
    scope = Scope(salt="s", extra_key="k")
    assert Scope.from_dict(json.loads(json.dumps(scope.as_dict()))) == scope
    assert scope.describe() == "salt='s', extra_key='k'"
    with pytest.raises(ValueError, match=r"Scope\.extra_key must be a non-empty str or "
                                         r"None, got ''"):
        Scope(extra_key="")
    sglang, reference = sglang_contract("0.5.23", 4), kvcache_contract(4)
    assert sglang.scope_key(Scope(extra_key="k")) != sglang.scope_key(Scope(salt="k"))
    assert sglang.scope_key(Scope(extra_key="k")) != sglang.scope_key(None)
    # before 0.5.22 the salt is SGLang's one extra key field: no extra key of its own
    assert "extra_key" not in sglang_contract("0.5.12", 4).scope_kinds
    assert reference.scope_key(Scope(extra_key="k")) is None


def test_a_lora_id_is_named_by_32_hex_digits() -> None:
    assert lora_id_text(1) == "0" * 31 + "1" and lora_id_text(255) == "0" * 30 + "ff"
