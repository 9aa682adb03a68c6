"""Every lock file in the repository validates; a bad one is refused naming the field;
a release without a lock is refused naming the committed ones and the commands that
resolve and commit one; post and dev versions, another Python's locks, and the nearest
lock a new release starts from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.conform.controller.locks import (
    DEFAULT_PYTHON,
    LOCK_DIR,
    Lock,
    LockError,
    UnsupportedVersion,
    base_of,
    find_lock,
    load_lock,
    lock_data,
    lock_name,
    nearest_lock,
    parse_lock,
    python_tag,
    supported,
)

LOCKS = sorted(LOCK_DIR.glob("*.json"))


def committed(engine: str, version: str) -> Lock:
    """A committed lock, whichever Python runs the test (find_lock looks for this one's)."""
    return load_lock(LOCK_DIR / lock_name(engine, version, DEFAULT_PYTHON))


@pytest.mark.parametrize("path", LOCKS, ids=[p.stem for p in LOCKS])
def test_every_lock_validates(path: Path) -> None:
    lock = load_lock(path)
    assert lock.key == path.stem and lock.deps
    assert not any(d.lower().startswith(("torch==", "nvidia")) for d in lock.deps)
    if lock.engine.startswith("sglang"):  # the CUDA torchvision build never goes in
        assert "torchvision" in {*lock.stubs.absent, *lock.stubs.raising}


def test_the_matrix_has_the_current_release_and_three_older_of_each() -> None:
    got = supported(python=DEFAULT_PYTHON)
    assert got["vllm"][-1] == "0.33.0" and len(got["vllm"]) >= 4
    assert got["sglang"][-1] == "0.5.23" and len(got["sglang"]) >= 4
    assert got["sglang"].index("0.5.5") < got["sglang"].index("0.5.10")  # numbers, not text


def _good() -> dict[str, Any]:
    return json.loads((LOCK_DIR / "vllm-0.33.0.json").read_text())


@pytest.mark.parametrize(("change", "message"), [
    pytest.param({"deps": ["torch==2.14.1"]}, r"deps: 'torch==2\.14\.1': torch comes from the "
                 r"harness's interpreter", id="torch-pin"),
    pytest.param({"deps": ["nvidia-cublas-cu12==12.8.4.1"]}, r"CUDA builds never go",
                 id="cuda-pin"),
    pytest.param({"deps": ["requests>=2"]}, r"'requests>=2' is not a name==version pin",
                 id="range"),
    pytest.param({"engine": "trtllm"}, r"engine: 'trtllm' has no adapter", id="engine"),
    pytest.param({"version": "0.32.0"}, r"file name: should be vllm-0\.32\.0\.json",
                 id="file-name"),
    pytest.param({"wheel": {"file": "vllm-0.33.0.tar.gz", "sha256": "0" * 64, "bytes": 1}},
                 r"wheel\.file: 'vllm-0\.33\.0\.tar\.gz' is not vllm-0\.33\.0-\*\.whl",
                 id="sdist"),
    pytest.param({"python": 3.11}, r"python: 3\.11 is not a Python version", id="python"),
    pytest.param({"python": "3.12"}, r"file name: should be vllm-0\.33\.0-py3\.12\.json",
                 id="python-file-name"),
    pytest.param({"version": "0.33"}, r"file name", id="short-version"),
    pytest.param({"version": "latest"}, r"version: 'latest' is not a version", id="version"),
    pytest.param({"resolved": {"how": "x", "module": "os"}}, r"resolved: expected an object "
                 r"with keys among", id="resolved-key"),
    pytest.param({"module": "vllm.x"}, r"unknown keys \['module'\]", id="unknown-key"),
    pytest.param({"stubs": {"raising": {"torch": ""}}}, r"give the reason", id="stub"),
])
def test_a_bad_lock_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(LockError, match=message):
        parse_lock({**_good(), **change}, LOCK_DIR / "vllm-0.33.0.json")


def test_a_release_without_a_lock_names_the_committed_ones_and_the_fix() -> None:
    with pytest.raises(UnsupportedVersion, match=r"vllm 0\.30\.5 has no lock for Python "
                       r"3\.\d+; committed( for 3\.11)?: 0\.10\.2, .*0\.33\.0\. `kvharness conform "
                       r"vllm==0\.30\.5` resolves one at first use; `kvharness conform lock "
                       r"vllm==0\.30\.5` writes it into"):
        find_lock("vllm", "0.30.5")
    with pytest.raises(UnsupportedVersion, match=r"no adapter for 'trtllm'"):
        find_lock("trtllm", "1.2.1")


def _write(folder: Path, data: dict[str, Any]) -> Path:
    path = folder / lock_name(data["engine"], data["version"], data["python"])
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("version", "wheel"), [
    pytest.param("0.5.6.post2", "sglang-0.5.6.post2-py3-none-any.whl", id="post"),
    pytest.param("0.5.24.dev3+gabc1234", "sglang-0.5.24.dev3+gabc1234-py3-none-any.whl",
                 id="dev-local"),
])
def test_a_lock_takes_post_and_dev_versions(version: str, wheel: str, tmp_path: Path) -> None:
    data = {**lock_data(committed("sglang", "0.5.5")), "version": version,
            "wheel": {"file": wheel, "sha256": "0" * 64, "bytes": 1}}
    lock = load_lock(_write(tmp_path, data))
    assert (lock.version, lock.spec) == (version, f"sglang=={version}")
    assert supported(tmp_path, DEFAULT_PYTHON)["sglang"] == [version]


def test_a_resolved_lock_is_found_after_the_committed_ones(tmp_path: Path) -> None:
    base = committed("vllm", "0.28.0")
    data = {**lock_data(base), "version": "0.30.5",
            "wheel": {"file": "vllm-0.30.5-cp38-abi3-manylinux_2_28_x86_64.whl",
                      "sha256": "1" * 64, "bytes": 7},
            "resolved": {"base": "0.28.0", "python": base.python, "pip": "23.2.1",
                         "date": "2026-12-02", "added": [], "how": "resolve"}}
    path = _write(tmp_path, data)
    if base.python != python_tag():
        pytest.skip(f"find_lock looks for Python {python_tag()}'s locks; these are "
                    f"{base.python}'s")
    lock = find_lock("vllm", "0.30.5", resolved_dir=tmp_path)
    assert lock.path == path and not lock.committed and lock.resolved == data["resolved"]
    assert find_lock("vllm", "0.28.0", resolved_dir=tmp_path).committed
    assert lock_data(lock) == data  # the file round-trips


def test_another_pythons_lock_is_named_for_it_and_listed_only_for_it(tmp_path: Path) -> None:
    data = {**lock_data(committed("vllm", "0.33.0")), "python": "3.12"}
    path = _write(tmp_path, data)
    assert path.name == "vllm-0.33.0-py3.12.json"
    assert load_lock(path).python == "3.12"
    assert supported(tmp_path, "3.12")["vllm"] == ["0.33.0"]
    assert supported(tmp_path, "3.11")["vllm"] == []


@pytest.mark.parametrize(("version", "want"), [
    pytest.param("0.30.0", "0.28.0", id="between"),
    pytest.param("0.34.0.dev1", "0.33.0", id="dev"),
    pytest.param("0.9.2", "0.10.2", id="older"),
])
def test_a_new_release_starts_from_the_nearest_lock(version: str, want: str,
                                                    tmp_path: Path) -> None:
    for known in ("0.10.2", "0.28.0", "0.33.0"):
        (tmp_path / f"vllm-{known}.json").write_bytes((LOCK_DIR / f"vllm-{known}.json").read_bytes())
    lock = nearest_lock("vllm", version, tmp_path)
    assert lock is not None and lock.version == want


def test_an_engine_of_anothers_package_starts_from_its_lock_of_the_same_release(
        tmp_path: Path) -> None:
    """sglang_unified installs sglang's wheel: a release sglang has a lock of starts from
    that lock (the same wheel, the same pins), before sglang_unified's own nearest; a
    release neither has starts from sglang_unified's own nearest."""
    for name in ("sglang-0.5.21", "sglang_unified-0.5.22"):
        (tmp_path / f"{name}.json").write_bytes((LOCK_DIR / f"{name}.json").read_bytes())
    same = nearest_lock("sglang_unified", "0.5.21", tmp_path)
    assert same is not None and (same.engine, same.version) == ("sglang", "0.5.21")
    near = nearest_lock("sglang_unified", "0.5.20", tmp_path)
    assert near is not None and (near.engine, near.version) == ("sglang_unified", "0.5.22")


def test_a_resolved_locks_base_names_its_engine() -> None:
    assert base_of("vllm", "0.28.0") == "vllm 0.28.0"
    assert base_of("sglang_unified", "sglang==0.5.21") == "sglang 0.5.21"
    assert base_of("sglang", None) == "?"


def test_the_unified_tree_installs_sglangs_own_wheel_with_its_pools_real() -> None:
    """sglang_unified drives UnifiedRadixCache: the same wheel as sglang's lock, pip asked
    for `sglang==`, its own venv, and the device pools and metrics real (never stubbed:
    the tree's import chain and SGLang's scheduler code need them), only torchvision
    raising and primed; from 0.5.22 sglang's own lock is the same (its scheduler code
    runs on those pools)."""
    unified, radix = committed("sglang_unified", "0.5.23"), committed("sglang", "0.5.23")
    assert unified.wheel == radix.wheel
    assert (unified.requirement, unified.spec) == ("sglang==0.5.23", "sglang_unified==0.5.23")
    assert unified.key != radix.key  # a venv of its own
    assert set(radix.deps) == set(unified.deps)
    for lock in (unified, radix, find_lock("sglang", "0.5.22")):
        assert set(lock.stubs.raising) == {"torchvision"}, lock.path
        assert lock.stubs.prime == ("torchvision",) and not lock.stubs.absent
