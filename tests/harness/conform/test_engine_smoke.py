"""A fast smoke of each pinned engine, where its cached install exists (never installs):
the worker loads it, the self-test passes and refuses every substitute, and two checks
pass (for shortfin, every locked release: one is skipped, the other judged as its
findings say). The full runs are post-merge (test_engine_full.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.conform.adapters.shortfin import era
from harness.conform.controller import install
from harness.conform.controller.locks import Lock, distribution, find_lock, pinned, supported
from harness.conform.controller.runner import conform

# one smoke per engine package (sglang_unified drives SGLang's wheel too: its whole run is
# post-merge, test_engine_full.py); shortfin's releases have findings, so they have a
# smoke of their own below
PINNED = [lock for lock in pinned()
          if distribution(lock.engine) == lock.engine and lock.engine != "shortfin"]


@pytest.mark.parametrize("lock", PINNED, ids=[lock.engine for lock in PINNED])
def test_a_cached_engine_loads_self_tests_and_passes(lock: Lock, tmp_path: Path) -> None:
    spec, engine, version = lock.spec, lock.engine, lock.version
    if install.installed(lock) is None:
        pytest.skip(f"{spec} is not installed in {install.cache_dir()} (kvharness conform "
                    f"{spec} installs it)")
    report = conform(spec, tmp_path, seeds=1,
                     only=["cold_then_warm", "scope_isolation", "decode_preempts",
                           "sliding_window"], say=lambda _: None)
    assert report.exit_code == 0, report.reason or [c.message for c in report.failed]
    if engine == "vllm":  # its own Scheduler drives the cache: it preempts, it has windows
        status = {c.name: c.status for c in report.checks}
        assert status["decode_preempts"] == status["sliding_window"] == "pass"
        assert report.contract["decode_refusal"] == "preempts-last"
    assert report.install["reused"] is True
    st = report.self_test
    assert st["problems"] == [] and st["substitutes"] == 3 * len(st["sources"]) > 20
    assert all(f"/site-packages/{engine}/" in src for src in st["sources"].values())
    assert report.worker["package_dir"].startswith(str(install.cache_dir()))
    assert report.contract["engine"] == engine and report.contract["version"] == version


SHORTFIN = supported()["shortfin"]


@pytest.mark.parametrize("version", SHORTFIN)
def test_a_cached_shortfin_release_loads_self_tests_and_is_judged(version: str,
                                                                 tmp_path: Path) -> None:
    if install.installed(find_lock("shortfin", version)) is None:
        pytest.skip(f"shortfin=={version} is not installed in {install.cache_dir()} "
                    f"(kvharness conform shortfin=={version} installs it)")
    report = conform(f"shortfin=={version}", tmp_path, seeds=0,
                     only=["scope_isolation", "branches"], say=lambda _: None)
    assert report.install["reused"] is True and report.reason == ""
    st = report.self_test
    assert st["problems"] == [] and st["substitutes"] == 3 * len(st["sources"]) >= 24
    assert all("/site-packages/shortfin_apps/" in src for src in st["sources"].values())
    status = {c.name: c.status for c in report.checks}
    assert status["scope_isolation"] == "skip"
    # 3.1.0-3.7.0 leak every request's unpublished last page (finding 8): branches fails
    assert status["branches"] == ("pass" if era(version) == "decoder" else "fail")


def test_the_cached_vllm_runs_hybrid_state_with_its_mamba_group(tmp_path: Path) -> None:
    """vLLM 0.33.0's scheduler over a full and a Mamba "align" group: the family passes
    under its chunk-end rule, and so do the fuzz seeds that open a Mamba group (seed 0;
    17 and 20 append several tokens at once; 5 drew a window and a state group, which
    the fuzz no longer asks for together)."""
    lock = find_lock("vllm", "0.33.0")
    if install.installed(lock) is None:
        pytest.skip(f"{lock.spec} is not installed in {install.cache_dir()} (kvharness "
                    f"conform {lock.spec} installs it)")
    report = conform(lock.spec, tmp_path, seeds=21, only=["hybrid_state"],
                     say=lambda _: None)
    assert report.exit_code == 0, report.reason or [c.message for c in report.failed]
    assert {c.name: c.status for c in report.checks}["hybrid_state"] == "pass"
    assert "state_interval" in report.contract["options"]
