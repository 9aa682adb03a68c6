"""Scope, Contract and Op: validated at construction, keyed by contract, round-tripped
through JSON (what the worker pipe and a replay file carry)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from harness.conform import ops
from harness.conform.adapters.kvcache import contract as kvcache_contract
from harness.conform.adapters.sglang import contract as sglang_contract
from harness.conform.adapters.vllm import contract as vllm_contract
from harness.conform.ops import Op, ops_from_json, ops_to_json
from harness.conform.protocol import Contract, Scope
from harness.conform.stubs import StubSpec


@pytest.mark.parametrize(("kwargs", "message"), [
    pytest.param({"salt": ""}, r"Scope\.salt must be a non-empty str or None, got ''",
                 id="empty-salt"),
    pytest.param({"salt": 1}, r"Scope\.salt must be a non-empty str or None, got 1",
                 id="int-salt"),
    pytest.param({"lora_name": "x", "lora_id": 0, "lora_path": "/p"},
                 r"Scope\.lora_id must be an int >= 1 or None, got 0", id="lora-id-zero"),
    pytest.param({"lora_name": "x", "lora_id": 1},
                 r"a LoRA needs lora_name, lora_id and lora_path together", id="lora-no-path"),
])
def test_a_bad_scope_names_its_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Scope(**kwargs)  # type: ignore[arg-type]


def test_scope_json_round_trip_and_the_default_scope() -> None:
    s = Scope.lora("x", 3, "/loras/1", salt="y")
    assert Scope.from_dict(json.loads(json.dumps(s.as_dict()))) == s
    assert Scope.from_dict({}) is None and Scope.from_dict(None) is None
    with pytest.raises(ValueError, match=r"here: unknown keys \['lora'\]"):
        Scope.from_dict({"lora": 1}, "here")


@pytest.mark.parametrize(("read", "data", "message"), [
    pytest.param(Scope.from_dict, ["salt"], "here: expected an object, got list", id="scope"),
    pytest.param(Contract.from_dict, 7, "here: expected an object, got int", id="contract"),
    pytest.param(Op.from_dict, "free", "here: expected an object, got str", id="op"),
    pytest.param(StubSpec.from_dict, {"absent": {}, "mock": 1, "fake": 2},
                 "here: unknown keys ['fake', 'mock']; known: absent, raising, names, prime, "
                 "overrides",
                 id="stubs"),
    pytest.param(Scope.from_dict, {"salt": "x", "lora": 1}, "here: unknown keys ['lora']; "
                 "known: salt, lora_name, lora_id, lora_path, extra_key", id="scope-keys"),
])
def test_every_record_read_from_json_refuses_what_is_not_its_object(
        read: Callable[[object, str], object], data: object, message: str) -> None:
    """One reading of a JSON object for every record the pipe carries: a non-object is
    named by its type, every unknown key by name, with the keys that are known."""
    with pytest.raises(ValueError) as info:
        read(data, "here")
    assert str(info.value) == message


def test_a_salt_and_a_lora_name_of_equal_value_keep_distinct_keys() -> None:
    c = kvcache_contract(4)
    assert c.scope_key(Scope(salt="x")) != c.scope_key(Scope.lora("x", 1))
    assert c.scope_key(None) is None and c.scope_key(Scope()) is None


@pytest.mark.parametrize(("version", "same", "apart"), [
    # vLLM 0.31 on keys LoRA by (name, path): an id is not part of the key
    pytest.param("0.33.0", (Scope.lora("x", 1), Scope.lora("x", 3, "/loras/1")),
                 (Scope.lora("x", 1), Scope.lora("x", 2)), id="vllm-0.33-name-path"),
    # 0.11.1-0.30.0 key by the name alone, a bug (vllm-project/vllm#30931): judged by
    # 0.31's key, so another adapter under the name must not share
    pytest.param("0.28.0", (Scope.lora("x", 1), Scope.lora("x", 3, "/loras/1")),
                 (Scope.lora("x", 1), Scope.lora("x", 2)), id="vllm-0.28-name-path"),
    # 0.10.2 and 0.11.0 by the integer id (lora_int_id)
    pytest.param("0.10.2", (Scope.lora("x", 1), Scope.lora("y", 1)),
                 (Scope.lora("x", 1), Scope.lora("x", 3, "/loras/1")), id="vllm-0.10-id"),
])
def test_vllm_lora_identity_follows_its_release(version: str, same: tuple[Scope, Scope],
                                                apart: tuple[Scope, Scope]) -> None:
    c = vllm_contract(version, 4, True)
    assert c.scope_key(same[0]) == c.scope_key(same[1])
    assert c.scope_key(apart[0]) != c.scope_key(apart[1])


def test_sglang_keys_lora_by_id() -> None:
    c = sglang_contract("0.5.23", 4)
    assert c.scope_key(Scope.lora("x", 1)) == c.scope_key(Scope.lora("y", 1))


def test_a_contract_round_trips_and_refuses_unknown_values() -> None:
    c = vllm_contract("0.33.0", 4, True)
    assert Contract.from_dict(json.loads(json.dumps(c.as_dict()))) == c
    bad = {**c.as_dict(), "matchable_at": "forward"}
    with pytest.raises(ValueError, match=r"Contract\.matchable_at must be one of "
                                         r"\('commit', 'allocation', 'prefill', 'extend'\), got "
                                         r"'forward'"):
        Contract.from_dict(bad)
    with pytest.raises(ValueError, match=r"unknown keys \['units'\]"):
        Contract.from_dict({**c.as_dict(), "units": "blocks"})


@pytest.mark.parametrize(("data", "message"), [
    pytest.param({"kind": "admit", "seq": "A", "tokens": []}, r"ops\[0\]: admit op for 'A': "
                 r"no tokens", id="admit-empty"),
    pytest.param({"kind": "commit", "seq": "A", "num_tokens": -1},
                 r"num_tokens must be an int >= 0, got -1", id="commit-negative"),
    pytest.param({"kind": "free", "seq": "A", "tokens": [1]},
                 r"a free op: unknown keys \['tokens'\]; known: kind, seq", id="free-tokens"),
    pytest.param({"kind": "flush"}, r"kind must be one of", id="unknown-kind"),
    pytest.param({"kind": "admit", "seq": "A", "tokens": [1, True]},
                 r"token True is not an int", id="token-bool"),
])
def test_a_bad_op_names_its_place_and_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ops_from_json([data])


def test_ops_round_trip_and_describe_themselves() -> None:
    op_list = [ops.admit("A", range(100, 118), Scope(salt="x"), 8), ops.reserve("A", 16),
               ops.commit("A", 16), ops.append("A", [5]), ops.free("A"), ops.evict(2)]
    assert ops_from_json(json.loads(json.dumps(ops_to_json(op_list)))) == op_list
    assert op_list[0].describe() == "admit(A, 18 tokens 100..117, salt='x', first_chunk=8)"
    # every token is written (runs as first..last): the text reproduces the op
    assert Op("admit", "B", (5, 9, 2, 7, 1)).describe() == \
        "admit(B, 5 tokens [5, 9, 2, 7, 1])"
    assert Op("admit", "C", (20, 21, 22, 23, 7, 8, 9, 10, 7, 8, 9, 10, 1)).describe() == \
        "admit(C, 13 tokens [20..23, 7..10, 7..10, 1])"
    assert ops.evict(2).describe() == "evict(2)"


def test_the_unified_contract_is_radix_caches_but_for_who_frees_duplicates() -> None:
    """UnifiedRadixCache keeps RadixCache's semantics; its insert frees the caller's
    duplicate slots itself, and its contract says where (the adapter then frees none)."""
    from harness.conform.adapters import sglang as sglang_adapter
    from harness.conform.adapters import sglang_unified as sglang_unified_adapter

    unified = sglang_unified_adapter.contract("0.5.23", 4)
    radix = sglang_adapter.contract("0.5.23", 4)
    assert unified.engine == "sglang_unified" and radix.engine == "sglang"
    same = {f for f in radix.as_dict() if f not in ("engine", "citations", "notes")}
    assert {f: unified.as_dict()[f] for f in same} == {f: radix.as_dict()[f] for f in same}
    assert any(k == "dedup_on_commit" and "FreeDeviceKV" in v for k, v in unified.citations)


def test_an_event_sent_as_a_subclass_is_known_by_its_base() -> None:
    from harness.conform.protocol import event_kind

    class BlockStored:
        pass

    class BlockStoredWithMetadata(BlockStored):  # SGLang 0.5.19's salted BlockStored
        pass

    class Heartbeat:
        pass

    assert event_kind(BlockStoredWithMetadata()) == "BlockStored"
    assert event_kind(BlockStored()) == "BlockStored"
    assert event_kind(Heartbeat()) == "Heartbeat"
@pytest.mark.parametrize(("field", "value", "message"), [
    pytest.param("preemption", "swap", r"Contract\.preemption must be one of \('none', "
                 r"'frees-keeps-cached', 'retracts-decode'\), got 'swap'", id="preemption"),
    pytest.param("chunking", "tokens", r"Contract\.chunking must be one of \('caller', "
                 r"'caller-page-floor', 'token-budget', 'token-budget-shared', 'page-budget'\), "
                 r"got 'tokens'", id="chunking"),
    pytest.param("event_fields", ("namespace",), r"Contract\.event_fields entry must be one "
                 r"of .*, got 'namespace'", id="event-field"),
    pytest.param("replicated", (("a", "b"),), r"Contract\.replicated entries are \(what, "
                 r"engine function, why\), three non-empty str, got \('a', 'b'\)",
                 id="replicated")])
def test_the_depth_fields_refuse_what_no_engine_has(field: str, value: object,
                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Contract.from_dict({**kvcache_contract(4).as_dict(), field: value})
