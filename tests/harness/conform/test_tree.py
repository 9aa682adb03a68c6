"""Where an engine comes from, without an engine: the spec's three forms, a source
tree's package root (SGLang's python/ layout) and its version (an unpacked wheel's
METADATA, _version.py, version.py, git describe)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.conform.controller.engine_spec import EngineSpec
from harness.conform.controller.tree import TreeError, package_root, tree_version


@pytest.mark.parametrize(("text", "engine", "version", "path"), [
    pytest.param("vllm", "vllm", None, None, id="bare"),
    pytest.param("vllm==0.33.0", "vllm", "0.33.0", None, id="release"),
    pytest.param("sglang==0.5.6.post2", "sglang", "0.5.6.post2", None, id="post"),
    pytest.param("vllm==0.33.1.dev3+gabc1234", "vllm", "0.33.1.dev3+gabc1234", None, id="dev"),
    pytest.param("vllm@/src/vllm", "vllm", None, Path("/src/vllm"), id="tree"),
    pytest.param("sglang_unified@/src/my sglang", "sglang_unified", None,
                 Path("/src/my sglang"), id="tree-space"),
    pytest.param("kvcache", "kvcache", None, None, id="kvcache"),
    # refused when run unless it is this checkout's (conform-kvcache-version)
    pytest.param("kvcache==0.1.0", "kvcache", "0.1.0", None, id="kvcache-version"),
    # a path is not held to the 100 characters of NAME==VERSION
    pytest.param("vllm@/" + "d" * 300, "vllm", None, Path("/" + "d" * 300), id="tree-long"),
])
def test_a_spec_parses(text: str, engine: str, version: str | None, path: Path | None) -> None:
    assert EngineSpec.parse(text) == EngineSpec(engine, version, path)


@pytest.mark.parametrize("text", ["vllm==latest", "vllm>=0.30", "vllm==", "vllm@",
                                  "kvcache@/x", "VLLM"])
def test_a_bad_spec_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=rf"engine spec {text!r}: expected NAME, "
                                         r"NAME==VERSION or NAME@PATH"):
        EngineSpec.parse(text)


def test_a_path_past_path_max_is_refused() -> None:
    text = "vllm@/" + "d" * 5000
    with pytest.raises(ValueError, match=r"engine spec 'vllm@/d+'\.\.\.: a path of 5001 "
                                         r"characters; at most 4096"):
        EngineSpec.parse(text)


def _package(root: Path, name: str, files: dict[str, str] | None = None) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    for file, text in (files or {}).items():
        (root / name / file).write_text(text)


def test_the_package_root_is_the_tree_or_its_python_folder(tmp_path: Path) -> None:
    _package(tmp_path / "vllm-src", "vllm")
    _package(tmp_path / "sglang-src" / "python", "sglang")
    assert package_root("vllm", tmp_path / "vllm-src") == (tmp_path / "vllm-src").resolve()
    assert package_root("sglang", tmp_path / "sglang-src") == \
        (tmp_path / "sglang-src" / "python").resolve()
    with pytest.raises(TreeError, match=r"no sglang/__init__\.py here or under .*python"):
        package_root("sglang", tmp_path / "vllm-src")


def test_the_version_comes_from_an_unpacked_wheels_metadata(tmp_path: Path) -> None:
    _package(tmp_path, "vllm", {"_version.py": "__version__ = version = '9.9.9'\n"})
    meta = tmp_path / "vllm-0.33.0.dist-info" / "METADATA"
    meta.parent.mkdir()
    meta.write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    assert tree_version("vllm", tmp_path) == ("0.33.0", str(meta))


@pytest.mark.parametrize(("file", "text", "want"), [
    pytest.param("_version.py", "__version__ = version = '0.33.1.dev3+gabc1234'\n",
                 "0.33.1.dev3+gabc1234", id="setuptools-scm"),
    pytest.param("version.py", '__version__ = "0.5.6.post2"\n', "0.5.6.post2", id="literal"),
])
def test_the_version_comes_from_the_packages_own_file(tmp_path: Path, file: str, text: str,
                                                      want: str) -> None:
    _package(tmp_path, "sglang", {file: text})
    assert tree_version("sglang", tmp_path) == (want, str(tmp_path / "sglang" / file))


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


def test_a_checkout_is_versioned_as_setuptools_scm_would(tmp_path: Path) -> None:
    _package(tmp_path, "vllm", {"version.py": "__version__ = 'dev'\n"})
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "a")
    _git(tmp_path, "tag", "v0.33.0")
    assert tree_version("vllm", tmp_path)[0] == "0.33.0"
    for message in ("b", "c", "d"):
        (tmp_path / "vllm" / "x.py").write_text(message)
        _git(tmp_path, "add", ".")
        _git(tmp_path, "commit", "-qm", message)
    version, where = tree_version("vllm", tmp_path)
    assert version.startswith("0.33.1.dev3+g") and where.startswith("git describe")


def test_a_tree_that_names_no_version_is_refused(tmp_path: Path) -> None:
    _package(tmp_path, "vllm", {"version.py": "from ._version import __version__\n"})
    with pytest.raises(TreeError, match=r"cannot tell which release of vllm this is"):
        tree_version("vllm", tmp_path)
