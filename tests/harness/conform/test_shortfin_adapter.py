"""shortfin's adapter without shortfin: its contract per release, the caller era each
release's server uses, its locks, and which families can judge it (the engine runs are
in test_engine_smoke.py and test_engine_full.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from harness.conform.adapters import shortfin as shortfin_adapter
from harness.conform.adapters.kvcache import contract as kvcache_contract
from harness.conform.adapters.shortfin import contract, era
from harness.conform.controller.checks import CHECKS
from harness.conform.controller.locks import LOCK_DIR, find_lock, supported
from harness.conform.protocol import Contract, Scope

RELEASES = ("3.1.0", "3.2.0", "3.3.0", "3.4.0", "3.5.0", "3.6.0", "3.7.0", "3.8.0", "3.9.0")


def test_the_adapter_imports_without_shortfin() -> None:
    # the worker imports adapters before the engine: shortfin loads only inside `load`
    assert importlib.util.find_spec("shortfin") is None
    assert shortfin_adapter.contract("3.9.0", 4).engine == "shortfin"


@pytest.mark.parametrize("version", ["2.9.0", "2.9.2", "3.0.0"])
def test_releases_before_the_trie_have_no_contract(version: str) -> None:
    with pytest.raises(ValueError, match=rf"shortfin {version} has no "
                                         r"TriePagedAttentionCache \(it came in 3\.1\.0"):
        era(version)


@pytest.mark.parametrize(("version", "want"), [
    pytest.param("3.1.0", "allocation", id="3.1.0"), pytest.param("3.7.0", "allocation", id="3.7.0"),
    pytest.param("3.8.0", "decoder", id="3.8.0"), pytest.param("3.9.0", "decoder", id="3.9.0")])
def test_each_release_is_driven_through_its_servers_caller(version: str, want: str) -> None:
    assert era(version) == want


def test_the_decoder_era_looks_up_all_but_the_last_page_and_publishes_at_prefill_end() -> None:
    c = contract("3.9.0", 4)
    assert (c.unreused_tail, c.matchable_at, c.last_token_cap) == (4, "prefill", "scheduler")
    assert c.dedup_on_commit and c.allocates_ahead and c.decode_steps and c.refusal_evicts
    cited = dict(c.citations)
    assert "input_ids[:-tokens_per_page]" in cited["last_token_cap"]
    assert "_allocation_block_size = 8" in cited["allocates_ahead"]


@pytest.mark.parametrize("version", ["3.1.0", "3.5.0", "3.6.0", "3.7.0"])
def test_the_allocation_era_matches_the_whole_prompt_and_keeps_duplicates(version: str) -> None:
    c = contract(version, 4)
    assert (c.unreused_tail, c.matchable_at, c.dedup_on_commit) == (0, "commit", False)
    dedup = dict(c.citations)["dedup_on_commit"]
    assert ("re-matches" in dedup) == (version >= "3.6.0")
    assert any("never reaches the trie" in n for n in c.notes) == (version == "3.7.0")


@pytest.mark.parametrize("version", RELEASES)
def test_no_scopes_counters_or_events_and_every_difference_cited(version: str) -> None:
    c = contract(version, 4)
    assert (c.scope_kinds, c.counters, c.events, c.scope_in_event_hash) == ((), (), False, ())
    assert c.scope_key(Scope(salt="x")) is None  # a salt reaches nothing: all scopes share
    reference = kvcache_contract(4)
    differs = {f for f in ("last_token_cap", "matchable_at", "dedup_on_commit",
                           "allocates_ahead", "refusal_evicts", "decode_steps", "events",
                           "scope_kinds", "eviction_policy")
               if getattr(c, f) != getattr(reference, f)}
    assert differs <= set(dict(c.citations)), differs - set(dict(c.citations))
    assert Contract.from_dict(json.loads(json.dumps(c.as_dict()))) == c


def test_scope_and_event_families_are_skipped_with_the_reason() -> None:
    c = contract("3.9.0", 4)
    reasons = {check.name: check.skip_reason(c) for check in CHECKS}
    assert {n for n, why in reasons.items() if why} == {
        "scope_isolation", "lora_name_repointed", "scope_event_hashes", "extra_key_isolation",
        "preemption_resume", "decode_preempts", "scheduler_chunks", "event_fields",
        "sliding_window", "window_off_page", "window_pool_short", "host_tier",
        "hybrid_state"}
    assert "keys its cache on no scope" in str(reasons["scope_isolation"])
    assert "keys its cache on no LoRA adapter" in str(reasons["lora_name_repointed"])
    assert "publishes no router events" in str(reasons["scope_event_hashes"])
    assert "no preemption path" in str(reasons["preemption_resume"])
    assert {check.name for check in CHECKS
            if check.skip_reason(kvcache_contract(4))} == {
                "scheduler_chunks", "sliding_window", "window_off_page", "window_pool_short",
                "extra_key_isolation"}


def test_every_release_with_the_trie_is_locked_and_none_before() -> None:
    assert supported()["shortfin"] == list(RELEASES)
    assert not list(LOCK_DIR.glob("shortfin-2.*.json")) and \
        not (LOCK_DIR / "shortfin-3.0.0.json").exists()


@pytest.mark.parametrize("version", RELEASES)
def test_a_lock_pins_what_the_import_chain_needs(version: str) -> None:
    lock = find_lock("shortfin", version)
    names = {pin.split("==")[0].lower().replace("_", "-"): pin.split("==")[1]
             for pin in lock.deps}
    assert {"tokenizers", "dataclasses-json", "marshmallow"} <= set(names)
    decoder = era(version) == "decoder"
    # the decoder's chain: shortfin.interop.fastapi, and iree.build from the paired compiler
    assert ("fastapi" in names) == decoder
    assert names.get("iree-base-compiler") == (version if decoder else None)
    assert lock.wheel.file.startswith(f"shortfin-{version}-cp311-cp311-")
