"""A finding the harness already knows is matched to its upstream issue, fix and first
fixed release by engine, release range, check, oracle (and, where one check shows two
findings, what its message says), and report.md says so beside the engine code the
failing op went through."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.conform.adapters import kvcache
from harness.conform.controller.checks import check_named
from harness.conform.controller.known_findings import KNOWN, match
from harness.conform.controller.report import Report, write_report
from harness.conform.controller.runner import check_all
from harness.conform.controller.targets import LocalTarget
from harness.conform.protocol import lora_id_text
from harness.conform.versions import parse_version
from tests.harness.conform import faults


@pytest.mark.parametrize(("engine", "version", "check", "oracle", "message", "number"), [
    pytest.param("vllm", "0.28.0", "scope_isolation", "count", "", 1, id="vllm-salt-name"),
    pytest.param("vllm", "0.31.0", "scope_isolation", "count", "", None, id="vllm-fixed"),
    pytest.param("vllm", "0.10.2", "scope_isolation", "count", "", None,
                 id="vllm-0.10-keys-on-the-id"),
    pytest.param("vllm", "0.26.0", "refused_then_retried", "refusal", "", 2, id="vllm-stats"),
    pytest.param("vllm", "0.27.1", "refused_then_retried", "refusal", "", None,
                 id="vllm-stats-fixed"),
    pytest.param("vllm", "0.30.0", "lora_name_repointed", "count", "", 15, id="vllm-name"),
    pytest.param("sglang", "0.5.6.post2", "cold_then_warm", "events", "", 6,
                 id="sglang-post-release"),
    pytest.param("sglang", "0.5.7", "cold_then_warm", "events", "", None, id="sglang-fixed"),
    pytest.param("sglang", "0.5.16", "eviction_order", "scenario", "", 19,
                 id="sglang-whole-size-eviction"),
    pytest.param("sglang", "0.5.17", "eviction_order", "scenario", "", None,
                 id="sglang-shortfall-eviction"),
    pytest.param("sglang", "0.5.8", "multi_turn", "count", "", 20,
                 id="sglang-prompt-only-insert"),
    pytest.param("sglang", "0.5.9", "decode_growth", "count", "", None,
                 id="sglang-decoded-tokens-inserted"),
    pytest.param("shortfin", "3.3.0", "decode_growth", "capacity",
                 "after append(A, tokens [902]): ...", 14, id="shortfin-by-message-14"),
    pytest.param("shortfin", "3.6.0", "decode_growth", "capacity", "after free(A): ...", 8,
                 id="shortfin-by-message-8"),
    pytest.param("shortfin", "3.9.0", "decode_growth", "capacity", "after free(A): ...", 11,
                 id="shortfin-newest"),
    # families newer than shortfin's findings, read from their op lists on 3.1.0-3.7.0:
    # a refused B leaves the root pinned (acquire_pages_for_tokens increments the matched
    # node before the allocation that fails), two live requests lose a copy (3.1-3.5)
    pytest.param("shortfin", "3.7.0", "refused_then_retried", "leaks",
                 "nothing is live, yet: ...", 12, id="shortfin-refused-pin-leaks"),
    pytest.param("shortfin", "3.8.0", "refused_then_retried", "leaks", "", None,
                 id="shortfin-refused-pin-fixed"),
    pytest.param("shortfin", "3.6.0", "eviction_order", "capacity", "after free(A2): ...", 8,
                 id="shortfin-eviction-order-leaks-a-page"),
    pytest.param("shortfin", "3.1.0", "dedup_across_split_path", "integrity",
                 "after commit(B, 20): ...", 13, id="shortfin-dedup-loses-a-copy"),
    pytest.param("vllm", "0.24.0", "window_off_page", "refusal", "", 2,
                 id="vllm-refused-lookup-counted-under-a-window"),
    pytest.param("sglang_unified", "0.5.19", "window_off_page", "capacity", "", 21,
                 id="sglang-unified-off-page-window"),
    pytest.param("sglang_unified", "0.5.23", "window_off_page", "capacity", "", None,
                 id="sglang-unified-whole-pages-of-window"),
    pytest.param("kvcache", "0.1.0", "scope_isolation", "count", "", None, id="unknown"),
])
def test_a_known_finding_is_matched_by_release_check_and_oracle(
        engine: str, version: str, check: str, oracle: str, message: str,
        number: int | None) -> None:
    found = match(engine, version, check, oracle, message)
    assert (found.number if found else None) == number


def test_releases_order_as_the_registry_reads_them() -> None:
    order = ["0.5.5", "0.5.5.post3", "0.5.6", "0.5.6.post1", "0.5.6.post2", "0.5.7",
             "0.5.10", "0.31", "0.31.0.post1", "0.33.1.dev3+gabc1234", "0.34.0"]
    assert sorted(order, key=lambda v: parse_version(v).key) == order
    assert parse_version("0.31").key == parse_version("0.31.0").key
    assert {k.number for k in KNOWN} == set(range(1, 22))


def test_report_md_names_the_engine_code_and_the_known_finding(tmp_path: Path) -> None:
    target = LocalTarget(kvcache.load(faults.SaltIsLora))
    report = Report("kvcache", "kvcache", "0.1.0", self_test=target.self_test())
    check_all(target, report, [check_named("scope_isolation")], 0, lambda _: None)
    found = report.checks[0]
    assert found.known == {}  # kvcache has no known finding
    text = write_report(report, tmp_path)[1].read_text()
    # the shrunk op list's last admission, its tokens renamed 1, 2, ...
    assert f"- the failing op, `admit(S7, tokens [1, 2], salt={lora_id_text(1)!r})`, goes " \
        "through " \
        "`kvcache/core/manager.py`: KvCacheManager.add_sequence, " \
        "KvCacheManager.take_copy_ops" in text
    # the same failure on a release the registry knows is annotated with upstream's word
    report.engine, report.version = "sglang", "0.5.12"
    report.checks.clear()
    check_all(target, report, [check_named("scope_isolation")], 0, lambda _: None)
    assert report.checks[0].known["number"] == 4
    text = write_report(report, tmp_path)[1].read_text()
    assert "- known: finding 4 of docs/conformance.md, a salt equal to a LoRA id shares that " \
        "adapter's KV: issue https://github.com/sgl-project/sglang/issues/24638; fix " \
        "https://github.com/sgl-project/sglang/pull/30827; first fixed in 0.5.18" in text
