"""Changed-file selection on a synthetic repository (its tests live in `suite/`: a
`tests` package would clash with this repository's): a change runs the tests whose
imports reach it (transitively, through conftest.py and relative imports), the
always_run core, and the blocks whose globs claim it; every other test is in the
not-run manifest; an unclaimed non-Python change runs everything."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness.plugin.changes import ImportGraph, dependencies

pytest_plugins = ["pytester"]

FILES = {
    "mylib/__init__.py": "",
    "mylib/a.py": "def a(): return 1\n",
    "mylib/b.py": "from mylib.c import c\ndef b(): return c()\n",
    "mylib/c.py": "def c(): return 2\n",
    "mylib/fixtures.py": "VALUE = 3\n",
    "suite/__init__.py": "",
    "suite/support.py": "from mylib import a\n",
    "suite/conftest.py": "from mylib.fixtures import VALUE\n",
    "suite/test_a.py": "from .support import a\ndef test_a(): assert a.a() == 1\n",
    "suite/test_b.py": "from mylib.b import b\ndef test_b(): assert b() == 2\n",
    "suite/test_core.py": "def test_core(): pass\n",
    "suite/test_docs.py": "def test_docs(): pass\n",
    "docs/guide.md": "# guide\n",
    "README.md": "# readme\n",
    "lists/test-db/l0_cpu.yml": """\
version: 0.0.1
l0_cpu:
- condition: {terms: {stage: pre_merge}}
  always_run: true
  tests:
  - suite/test_core.py
- condition: {terms: {stage: pre_merge}}
  tests:
  - suite/test_a.py
  - suite/test_b.py
- condition: {terms: {stage: pre_merge}}
  source_file_dependencies: ['docs/*']
  tests:
  - suite/test_docs.py
""",
}


def _git(root: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e"}
    subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True)


@pytest.fixture
def repo(quiet_pytester: pytest.Pytester) -> pytest.Pytester:
    root = quiet_pytester.path
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "base")
    return quiet_pytester


def test_dependencies_follow_imports_conftests_and_relative_imports(repo: pytest.Pytester) -> None:
    graph = ImportGraph(repo.path)
    assert dependencies(graph, "suite/test_a.py") == {
        "suite/test_a.py", "suite/__init__.py", "suite/support.py", "suite/conftest.py",
        "mylib/__init__.py", "mylib/a.py", "mylib/fixtures.py"}
    assert "mylib/c.py" in dependencies(graph, "suite/test_b.py")  # through mylib/b.py


def _run(repo: pytest.Pytester) -> tuple[pytest.RunResult, dict[str, object]]:
    result = repo.runpytest("--kvh-test-db", "lists/test-db", "--kvh-changed-since", "main",
                            "--kvh-results-dir", "out")
    manifest = json.loads((repo.path / "out" / "not_run.json").read_text())
    return result, manifest


def _passed(result: pytest.RunResult) -> list[str]:
    reports = result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
    return sorted(r.nodeid.split("::")[1] for r in reports if r.when == "call" and r.passed)


@pytest.mark.parametrize(
    ("path", "text", "ran"),
    [
        pytest.param("mylib/c.py", "def c(): return 2  # edited\n", ["test_b", "test_core"],
                     id="transitive-import"),
        pytest.param("mylib/fixtures.py", "VALUE = 4\n",
                     ["test_a", "test_b", "test_core", "test_docs"], id="conftest-import"),
        pytest.param("suite/support.py", "from mylib import a  # edited\n",
                     ["test_a", "test_core"], id="relative-import"),
        pytest.param("docs/guide.md", "# guide, edited\n", ["test_core", "test_docs"],
                     id="glob-claims-a-doc"),
        pytest.param("README.md", "# readme, edited\n", ["test_core"], id="doc-runs-the-core"),
        pytest.param("mylib/new.py", "X = 1\n", ["test_core"], id="untracked-unused"),
    ],
)
def test_a_change_runs_what_it_can_affect(repo: pytest.Pytester, path: str, text: str,
                                          ran: list[str]) -> None:
    (repo.path / path).write_text(text)
    result, manifest = _run(repo)
    assert result.ret == pytest.ExitCode.OK
    assert _passed(result) == ran
    not_run = {t["node_id"].split("::")[1]: t["reason"] for t in manifest["not_run"]}  # type: ignore[attr-defined]
    assert sorted(not_run) == sorted({"test_a", "test_b", "test_core", "test_docs"} - set(ran))
    assert manifest["changed_files"] == [path]
    result.stdout.fnmatch_lines([f"kvharness changed since main: 1 files; {len(not_run)} "
                                 "selected tests not run (their sources did not change)"])
    if "test_a" in not_run:
        assert not_run["test_a"] == "none of its 7 source files changed"


def test_an_unclaimed_non_python_change_runs_everything(repo: pytest.Pytester) -> None:
    lists = repo.path / "lists" / "test-db" / "l0_cpu.yml"
    lists.write_text(lists.read_text() + "# edited\n")
    result, manifest = _run(repo)
    assert _passed(result) == ["test_a", "test_b", "test_core", "test_docs"]
    assert manifest["run_all_because"] == ("lists/test-db/l0_cpu.yml changed and no block's "
                                           "source_file_dependencies claims it")


def test_bytecode_is_no_change(repo: pytest.Pytester) -> None:
    """Running the tests writes `__pycache__` where no .gitignore names it (this
    repository has none): an unclaimed non-Python file, which would run everything."""
    (repo.path / "mylib" / "__pycache__").mkdir(exist_ok=True)
    (repo.path / "mylib" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0" * 16)
    (repo.path / "mylib" / "old.pyc").write_bytes(b"\0" * 16)
    (repo.path / "README.md").write_text("# readme, edited\n")
    result, manifest = _run(repo)
    assert manifest["changed_files"] == ["README.md"] and manifest["run_all_because"] is None
    assert _passed(result) == ["test_core"]


def test_a_committed_change_on_a_branch_counts(repo: pytest.Pytester) -> None:
    _git(repo.path, "checkout", "-q", "-b", "topic")
    (repo.path / "mylib" / "a.py").write_text("def a(): return 1  # edited\n")
    _git(repo.path, "commit", "-q", "-am", "edit a")
    result, _ = _run(repo)
    assert _passed(result) == ["test_a", "test_core"]


@pytest.mark.parametrize(("ref", "message"), [
    pytest.param("no-such-ref", "*--kvh-changed-since no-such-ref: 'no-such-ref' names no commit "
                 "in this repository; give a branch, tag or commit id*", id="unknown"),
    # A tree is an object git resolves, but no commit a branch could have left.
    pytest.param("HEAD^{tree}", "*--kvh-changed-since HEAD^{tree}: 'HEAD^{tree}' names no commit*",
                 id="tree"),
    pytest.param("main..HEAD", "*--kvh-changed-since main..HEAD: 'main..HEAD' names no commit*",
                 id="range"),
    # git merge-base would read these as its own options: --octopus silently meant HEAD.
    pytest.param("--octopus", "*--kvh-changed-since --octopus: a ref cannot start with '-' (git "
                 "would read it as an option); give a branch, tag or commit id*", id="option"),
    pytest.param("-", "*--kvh-changed-since -: a ref cannot start with '-'*", id="dash"),
])
def test_a_bad_ref_is_a_usage_error(repo: pytest.Pytester, ref: str, message: str) -> None:
    result = repo.runpytest("--kvh-test-db", "lists/test-db", f"--kvh-changed-since={ref}",
                            "--kvh-results-dir", "out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert not (repo.path / "out" / "not_run.json").exists(), "the run went ahead"


def test_a_ref_may_be_a_tag_or_a_commit_id(repo: pytest.Pytester) -> None:
    _git(repo.path, "tag", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo.path, capture_output=True,
                          text=True, check=True).stdout.strip()
    (repo.path / "mylib" / "a.py").write_text("def a(): return 1  # edited\n")
    for ref in ("base", base[:12], f"{base}^{{commit}}"):
        result = repo.runpytest("--kvh-test-db", "lists/test-db", f"--kvh-changed-since={ref}")
        assert result.ret == pytest.ExitCode.OK, ref
        assert _passed(result) == ["test_a", "test_core"], ref
