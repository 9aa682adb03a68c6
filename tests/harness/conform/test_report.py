"""report.json and report.md: every check, each finding with its op list, the exit code."""

from __future__ import annotations

import json
from pathlib import Path

from harness.conform.adapters import kvcache
from harness.conform.controller.checks import check_named
from harness.conform.controller.report import CheckResult, Report, markdown, write_report
from harness.conform.controller.runner import check_all
from harness.conform.controller.targets import LocalTarget
from tests.harness.conform import faults


def _report() -> Report:
    bad = CheckResult("scope_isolation", "scope isolation", "salts and LoRAs", "fail",
                      "count", "admit(S7, ...) reused 16 tokens | of LoRA 1",
                      ({"kind": "admit", "seq": "S0", "tokens": [1, 2]},),
                      ("admit(S0, tokens [1, 2])",), 30, 64, 0.5, also=("provenance: ...",))
    good = CheckResult("cold_then_warm", "cold then warm", "cold, warm", "pass", seconds=0.1)
    return Report("sglang==0.5.12", "sglang", "0.5.12", 1, contract={"engine": "sglang"},
                  checks=[good, bad], seconds={"total": 3.0})


def test_both_files_say_the_same(tmp_path: Path) -> None:
    as_json, as_md = write_report(_report(), tmp_path / "out")
    data = json.loads(as_json.read_text())
    assert data["exit_code"] == 1
    assert [c["status"] for c in data["checks"]] == ["pass", "fail"]
    assert data["checks"][1]["ops"] == [{"kind": "admit", "seq": "S0", "tokens": [1, 2]}]
    text = as_md.read_text()
    assert "**violations found** (exit 1): 1 of 2 checks failed" in text
    assert "## Finding: scope_isolation (count)" in text
    assert "admit(S0, tokens [1, 2])" in text and "- also: provenance: ..." in text
    # a | in a message stays inside its table cell
    assert "reused 16 tokens \\| of LoRA 1" in text


def test_a_run_that_could_not_run_says_why() -> None:
    lines = markdown(Report("vllm==0.30.0", reason="vllm 0.30.0 is not supported"))
    assert lines[2] == "**could not run** (exit 2): vllm 0.30.0 is not supported"


RESOLVED = {"base": "0.28.0", "python": "3.11", "pip": "23.2.1", "date": "2026-12-02",
            "added": ["blake3 (the import asked for blake3)"],
            "how": "harness.conform.controller.resolve"}


def test_an_unlocked_release_and_a_borrowed_contract_are_said_first() -> None:
    report = Report("vllm==0.30.0", "vllm", "0.30.0", 1,
                    source={"kind": "release", "lock": "/cache/locks/vllm-0.30.0.json",
                            "committed": False, "resolved": RESOLVED},
                    contract_basis={"version": "0.30.0", "known": "0.28.0", "detected": {
                        "lora_identity": "kv_cache_utils._gen_lora_extra_hash_keys reads "
                                         "lora_name"}})
    text = "\n".join(markdown(report))
    assert "Lock: `/cache/locks/vllm-0.30.0.json`, **unlocked** (resolved 2026-12-02 from " \
           "vllm 0.28.0's lock: harness.conform.controller.resolve; added blake3" in text
    assert "Contract: vllm 0.28.0's (the nearest release with a contract); detected in this " \
           "release: lora_identity (kv_cache_utils._gen_lora_extra_hash_keys reads " \
           "lora_name)" in text
    assert text.splitlines()[4].startswith("Lock: ")  # right under the verdict


def test_a_resolved_locks_first_lines_say_how_and_how_to_commit_it(tmp_path: Path) -> None:
    from harness.conform.controller.engine_spec import _lock_lines
    from harness.conform.controller.locks import (
        DEFAULT_PYTHON,
        LOCK_DIR,
        load_lock,
        lock_data,
        lock_name,
    )

    data = {**lock_data(load_lock(LOCK_DIR / lock_name("vllm", "0.28.0", DEFAULT_PYTHON))),
            "version": "0.30.0", "resolved": RESOLVED,
            "wheel": {"file": "vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                      "sha256": "0" * 64, "bytes": 1}}
    path = tmp_path / "vllm-0.30.0.json"
    path.write_text(json.dumps(data))
    lines = _lock_lines(load_lock(path))
    assert lines[0].startswith("vllm==0.30.0 is unlocked: its lock was resolved on 2026-12-02 "
                               "from vllm 0.28.0's lock")
    assert "added: blake3 (the import asked for blake3)" in lines[0]
    assert "`kvharness conform lock vllm==0.30.0` writes it into the repository's locks" in lines[1]
    assert _lock_lines(load_lock(LOCK_DIR / lock_name("vllm", "0.28.0", DEFAULT_PYTHON))) == []


class _HostTierSettles(faults.SilentStores):
    """SilentStores (so a check fails) whose cache, opened with a host tier, says a commit
    goes through the host tier's code too: as SGLang's window cache goes through
    SWARadixCache (swa_radix_cache.py), not the plain cache's RadixCache."""

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        out = super().engine_callables()
        if self.manager.state.host is not None:
            out["settle"] = (self.manager.state.host, "settle")
        return out

    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        calls = super().engine_calls()
        if self.manager.state.host is not None:
            calls["commit"] = (*calls["commit"], "settle")
        return calls


def test_a_finding_names_the_code_of_the_cache_it_ran_on() -> None:
    """The self-test runs on a plain cache; a check opened with options (here a host
    tier) names what its own cache's op went through."""
    target = LocalTarget(kvcache.load(_HostTierSettles))
    report = Report("kvcache", "kvcache", "test", self_test=target.self_test())
    check_all(target, report, [check_named("host_tier")], 0, lambda _: None)
    (found,) = report.checks
    assert (found.status, found.options, found.ops[found.step or 0]["kind"]) == \
        ("fail", {"host_blocks": 8}, "commit")
    assert "settle" not in report.self_test["calls"]["commit"]
    assert found.went_through == ("kvcache/core/manager.py: KvCacheManager.commit",
                                  "kvcache/core/host_tier.py: HostTier.settle")
    assert "goes through `kvcache/core/manager.py`: KvCacheManager.commit; " \
        "`kvcache/core/host_tier.py`: HostTier.settle" in "\n".join(markdown(report))
