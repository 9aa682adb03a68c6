"""`kvharness conform vllm@PATH` on a source tree: the engine's Python files imported from
where they are (never installed) into a venv of the nearest lock's pins. The clean tree
of a locked release passes; the same tree with one planted bug is flagged by the check
that covers it. A bare `vllm` runs a dev version installed in the harness's interpreter.
Runs where the release's cached venv and the pins-only venv exist
(skipped otherwise, naming the commands that install them); `test_engine_full.py`
installs them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import harness
from harness.conform.controller import install
from harness.conform.controller.locks import find_lock
from harness.conform.controller.runner import conform
from tests.harness.conform.trees import RELEASE, make_tree, missing_venvs

DEV = "0.33.1.dev3+gabc1234"  # a branch three commits past 0.33.0, as setuptools-scm names it

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


def run_installed_dev(tmp_path: Path) -> None:
    """A bare `kvharness conform vllm` in an interpreter where vLLM is a dev version (a
    checkout on its path with its metadata, as an editable install leaves it): it runs
    that code with 0.33.0's stubs and contract, detecting what it can, and passes."""
    tree = make_tree(tmp_path / "dev", planted=False)
    meta = tree / f"vllm-{DEV}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {DEV}\n")
    env = install.installed(find_lock(*RELEASE.split("==")), engine_wheel=False)
    assert env is not None
    repo = Path(harness.__file__).resolve().parent.parent
    done = subprocess.run(
        [str(env.python), "-m", "harness.cli", "conform", "vllm", "--check", "cold_then_warm",
         "--seeds", "1", "--report", str(tmp_path / "report")], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{tree}"}, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"vllm {DEV} installed in {env.python}" in done.stdout
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (report["version"], report["source"]["kind"]) == (DEV, "installed")
    assert report["source"]["package_root"] == str(tree.resolve())
    assert report["contract_basis"]["known"] == "0.33.0"
    assert set(report["contract_basis"]["detected"]) == {"lora_identity", "counters"}
    assert report["contract"]["lora_identity"] == ["lora_name", "lora_path"]


def test_the_installed_dev_version_runs_with_the_nearest_contract(tmp_path: Path) -> None:
    why = missing_venvs()
    if why is not None:
        pytest.skip(why)
    run_installed_dev(tmp_path)
