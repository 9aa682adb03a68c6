"""`kvharness conform vllm@PATH` on a source tree: the engine's Python files imported from
where they are (never installed) into a venv of the nearest lock's pins. The clean tree
of a locked release passes; the same tree with one planted bug is flagged by the check
that covers it. Runs where the release's cached venv and the pins-only venv exist
(skipped otherwise, naming the commands that install them); `test_engine_full.py`
installs them."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.conform.runner import conform
from tests.harness.conform.trees import make_tree, missing_venvs

CHECKS = ["cold_then_warm", "scope_isolation"]


def run_tree(tmp_path: Path) -> None:
    """The clean tree exits 0; the planted one exits 1 with scope_isolation's count
    oracle; both report the tree as the engine's source and its code as the engine's."""
    clean = conform(f"vllm@{make_tree(tmp_path / 'clean', planted=False)}",
                    tmp_path / "clean-report", seeds=0, only=CHECKS, say=lambda _: None)
    assert clean.exit_code == 0, clean.reason or [c.message for c in clean.failed]
    assert clean.source["kind"] == "tree" and clean.version == "0.33.0"
    assert clean.worker["package_dir"] == str((tmp_path / "clean" / "vllm").resolve())
    assert all(src.startswith(str(tmp_path / "clean")) for src in
               clean.self_test["sources"].values() if "/vllm/" in src)
    buggy = conform(f"vllm@{make_tree(tmp_path / 'buggy', planted=True)}",
                    tmp_path / "buggy-report", seeds=0, only=CHECKS, say=lambda _: None)
    assert buggy.exit_code == 1, buggy.reason
    assert [(c.name, c.status, c.oracle) for c in buggy.checks] == [
        ("cold_then_warm", "pass", ""), ("scope_isolation", "fail", "count")]


def test_a_source_tree_is_checked_and_a_planted_bug_found(tmp_path: Path) -> None:
    why = missing_venvs()
    if why is not None:
        pytest.skip(why)
    run_tree(tmp_path)
