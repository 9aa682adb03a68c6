"""Contracts never excuse a known bug, and a known limitation is a verdict of its own.

A LoRA key on the name alone is refused as a contract (two adapters under one name would
share KV: vllm-project/vllm#30931), so vLLM 0.11.1-0.30.0's name key is a finding; a
behaviour upstream has acknowledged and not fixed (SGLang's event hashes without the
LoRA) is "known limitation": neither a pass nor a violation, exit 0, said as such.
Each is shown on kvcache's manager with the fault planted (tests/harness/conform/faults.py)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from harness.conform.adapters import kvcache
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.adapters.sglang import EVENT_HASH_RFC
from harness.conform.adapters.sglang import contract as sglang_contract
from harness.conform.adapters.sglang import detect as sglang_detect
from harness.conform.adapters.vllm import contract as vllm_contract
from harness.conform.adapters.vllm import detect as vllm_detect
from harness.conform.controller.checks import check_named
from harness.conform.controller.report import Report, markdown
from harness.conform.controller.runner import check_all, run_check
from harness.conform.controller.targets import LocalTarget
from harness.conform.protocol import settle
from tests.harness.conform import faults


def test_a_lora_key_on_the_name_alone_is_never_a_contract() -> None:
    c = kvcache.contract(4)
    with pytest.raises(ValueError, match=r"Contract\.lora_identity \('lora_name',\) does not "
                                         r"name the adapter .*vllm-project/vllm#30931"):
        replace(c, lora_identity=("lora_name",))


@pytest.mark.parametrize(("version", "identity", "quoted"), [
    pytest.param("0.10.2", ("lora_id",), "'Return LoRA id of the request if it is a LoRA "
                 "request' (lora_int_id)", id="0.10.2-int-id"),
    pytest.param("0.11.0", ("lora_id",), "(0.10.2's text)", id="0.11.0-int-id"),
    pytest.param("0.28.0", ("lora_name", "lora_path"), "'Return LoRA name of the request if "
                 "it is a LoRA request' (the name alone", id="0.28-name-is-a-bug"),
    pytest.param("0.33.0", ("lora_name", "lora_path"), "'The adapter path is included so "
                 "that re-pointing a LoRA name", id="0.33-name-path"),
])
def test_vllm_cites_its_lora_key_in_each_releases_own_words(
        version: str, identity: tuple[str, ...], quoted: str) -> None:
    c = vllm_contract(version, 4, True)
    assert c.lora_identity == identity
    assert quoted in dict(c.citations)["lora_identity"]


def test_sglang_quotes_each_releases_radix_key_and_names_the_event_hash_limitation() -> None:
    quotes = {v: dict(sglang_contract(v, 4).citations)["scope_in_event_hash"]
              for v in ("0.5.18", "0.5.19", "0.5.20", "0.5.22", "0.5.23")}
    for version in ("0.5.18", "0.5.19"):  # cache_salt arrived in 0.5.18
        assert "(0.5.18's text): cache_salt 'Cache salt is kept distinct" in quotes[version]
    for version in ("0.5.20", "0.5.22"):
        assert "(0.5.20's text): extra_key 'Namespaces the tree and storage; omitted from KV " \
            "events.'" in quotes[version]
    assert "'Namespaces the tree and storage; KV events see only its LoRA name.'" \
        in quotes["0.5.23"]
    for version in quotes:
        c = sglang_contract(version, 4)
        assert c.scope_in_event_hash == ("salt", "lora")
        assert c.limited("scope_in_event_hash") == {"lora": EVENT_HASH_RFC}
    # before 0.5.18 nothing acknowledges it: scopes missing from events are a finding
    for version in ("0.5.12", "0.5.17"):
        assert sglang_contract(version, 4).limitations == ()


def _keys_by_name(request: Any) -> list[Any]:
    # what vLLM 0.11.1-0.30.0's kv_cache_utils._gen_lora_extra_hash_keys reads
    return [request.lora_request.lora_name] if request.lora_request else []


def _keys_by_name_and_path(request: Any) -> list[Any]:
    lora = request.lora_request
    return [("lora", lora.lora_name, lora.lora_path)] if lora else []


@dataclasses.dataclass
class _PrefixCacheStats:  # vLLM's, 0.11 on: with preempted_*
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0


@pytest.mark.parametrize(("reads", "identity", "cited"), [
    pytest.param(_keys_by_name, ("lora_name", "lora_path"), "vllm-project/vllm#30931",
                 id="name-alone-stays-a-finding"),
    pytest.param(_keys_by_name_and_path, ("lora_name", "lora_path"),
                 "reads lora_name, lora_path", id="name-and-path"),
])
def test_a_detected_lora_key_is_one_a_contract_accepts(
        reads: Any, identity: tuple[str, ...], cited: str) -> None:
    """A release without a contract of its own (0.14.1 takes 0.10.2's, keyed on the id)
    settles its LoRA key from its code; a key on the name alone is judged as (name,
    path), never settled as the name alone, so lora_name_repointed still finds it."""
    v = SimpleNamespace(utils=SimpleNamespace(_gen_lora_extra_hash_keys=reads),
                        PrefixCacheStats=_PrefixCacheStats)
    c = settle(vllm_contract("0.10.2", 4, True), "0.14.1", vllm_detect(v))
    assert (c.version, c.lora_identity) == ("0.14.1", identity)
    assert cited in dict(c.citations)["lora_identity"]


@pytest.mark.parametrize(("has_salt", "limited"), [
    pytest.param(True, {"lora": EVENT_HASH_RFC}, id="salted-0.5.18-on"),
    pytest.param(False, {}, id="salt-in-the-extra-key"),
])
def test_a_detected_salt_never_excuses_the_lora_missing_from_event_hashes(
        has_salt: bool, limited: dict[str, str]) -> None:
    """A salted release settled from an unsalted one's contract (0.5.12's) keeps the
    reference (salt, LoRA) in event hashes: the LoRA left out is the known limitation
    sgl-project/sglang#39991, never a contract that leaves it out."""
    c = settle(sglang_contract("0.5.12", 4), "0.5.19",
               sglang_detect(SimpleNamespace(has_salt=has_salt)))
    assert c.scope_in_event_hash == ("salt", "lora")
    assert c.limited("scope_in_event_hash") == limited


@pytest.mark.parametrize(("entry", "message"), [
    pytest.param(("eviction", "lora", "x"), "field must be one of", id="field"),
    pytest.param(("scope_kinds", "page", "x"), "'page' is not in scope_kinds", id="value"),
    pytest.param(("scope_in_event_hash", "lora", ""), "upstream must be a non-empty str",
                 id="no-link"),
    pytest.param(("scope_in_event_hash", "lora"), r"expected \(field, value, upstream\)",
                 id="pair"),
])
def test_a_limitation_names_a_stated_value_and_its_upstream_link(
        entry: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(kvcache.contract(4), limitations=(entry,))


def test_a_lora_name_repointed_at_another_adapter_is_a_finding() -> None:
    check = check_named("lora_name_repointed")
    clean = run_check(LocalTarget(kvcache.load()), check)
    assert clean.status == "pass", clean.message
    found = run_check(LocalTarget(kvcache.load(faults.KeysLoraByName)), check)
    assert (found.status, found.oracle) == ("fail", "count"), found.message
    # shrunk to the re-pointed adapter's admission reusing the first one's KV
    assert re.search(r"lora=\('x', 2, '/loras/2'\)\) reused [1-9][0-9]* tokens; the count "
                     r"oracle predicts 0", found.message), found.message
    assert any("re-pointed from /loras/1 (id 1) to /loras/2 (id 2) reuses: got 17, "
               "expected 0" in a for a in found.also)


@pytest.mark.parametrize(("fault", "status", "exit_code", "verdict"), [
    pytest.param(faults.LoraOutOfEventHashes, "fail", 1, "violations", id="not-acknowledged"),
    pytest.param(faults.LoraOutOfEventHashesKnown, "limitation", 0, "known limitations",
                 id="acknowledged"),
])
def test_a_known_limitation_is_its_own_verdict(fault: type[KvcacheCache], status: str,
                                               exit_code: int, verdict: str) -> None:
    report = Report("kvcache", "kvcache", "test")
    check_all(LocalTarget(kvcache.load(fault)), report,
              [check_named("cold_then_warm"), check_named("scope_event_hashes")], 0,
              lambda _: None)
    assert [c.status for c in report.checks] == ["pass", status]
    assert (report.exit_code, report.verdict) == (exit_code, verdict)
    assert report.as_dict()["verdict"] == verdict
    text = "\n".join(markdown(report))
    if status == "limitation":
        assert "**known limitations** (exit 0): no violation; 1 of 2 checks found only " \
            "behaviour upstream has acknowledged" in text
        assert "## Known limitation: scope_event_hashes (scenario)" in text
        assert "a known limitation (https://example.invalid/rfc)" in text
        assert "**passed**" not in text
    else:
        assert "## Finding: scope_event_hashes (scenario)" in text
