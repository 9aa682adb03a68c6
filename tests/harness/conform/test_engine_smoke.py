"""A fast smoke of each pinned engine, where its cached install exists (never installs):
the worker loads it, the self-test passes and refuses every substitute, and two checks
pass. The full runs are post-merge (test_engine_full.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.conform.controller import install
from harness.conform.controller.locks import Lock, distribution, pinned
from harness.conform.controller.runner import conform

# one smoke per engine package (sglang_unified drives SGLang's wheel too: its whole run is
# post-merge, test_engine_full.py)
PINNED = [lock for lock in pinned() if distribution(lock.engine) == lock.engine]


@pytest.mark.parametrize("lock", PINNED, ids=[lock.engine for lock in PINNED])
def test_a_cached_engine_loads_self_tests_and_passes(lock: Lock, tmp_path: Path) -> None:
    spec, engine, version = lock.spec, lock.engine, lock.version
    if install.installed(lock) is None:
        pytest.skip(f"{spec} is not installed in {install.cache_dir()} (kvharness conform "
                    f"{spec} installs it)")
    report = conform(spec, tmp_path, seeds=1, only=["cold_then_warm", "scope_isolation"],
                     say=lambda _: None)
    assert report.exit_code == 0, report.reason or [c.message for c in report.failed]
    assert report.install["reused"] is True
    st = report.self_test
    assert st["problems"] == [] and st["substitutes"] == 3 * len(st["sources"]) > 20
    assert all(f"/site-packages/{engine}/" in src for src in st["sources"].values())
    assert report.worker["package_dir"].startswith(str(install.cache_dir()))
    assert report.contract["engine"] == engine and report.contract["version"] == version
