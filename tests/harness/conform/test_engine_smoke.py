"""A fast smoke of each pinned engine, where its cached install exists (never installs):
the worker loads it, the self-test passes and refuses every substitute, and two checks
pass. The full runs are post-merge (test_engine_full.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.conform.controller import install
from harness.conform.controller.locks import find_lock
from harness.conform.controller.runner import conform

PINNED = ("vllm==0.33.0", "sglang==0.5.23")


@pytest.mark.parametrize("spec", PINNED, ids=[s.split("==")[0] for s in PINNED])
def test_a_cached_engine_loads_self_tests_and_passes(spec: str, tmp_path: Path) -> None:
    engine, version = spec.split("==")
    if install.installed(find_lock(engine, version)) is None:
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
