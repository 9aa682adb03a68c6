"""Every lock file in the repository validates; a bad one is refused naming the field;
an unsupported version is refused naming the supported ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.conform.controller.locks import (
    LOCK_DIR,
    LockError,
    UnsupportedVersion,
    find_lock,
    load_lock,
    parse_lock,
    supported,
)

LOCKS = sorted(LOCK_DIR.glob("*.json"))


@pytest.mark.parametrize("path", LOCKS, ids=[p.stem for p in LOCKS])
def test_every_lock_validates(path: Path) -> None:
    lock = load_lock(path)
    assert lock.key == path.stem and lock.deps
    assert not any(d.lower().startswith(("torch==", "nvidia")) for d in lock.deps)
    if lock.engine.startswith("sglang"):  # the CUDA torchvision build never goes in
        assert "torchvision" in {*lock.stubs.absent, *lock.stubs.raising}


def test_the_matrix_has_the_current_release_and_three_older_of_each() -> None:
    got = supported()
    assert got["vllm"][-1] == "0.33.0" and len(got["vllm"]) >= 4
    assert got["sglang"][-1] == "0.5.23" and len(got["sglang"]) >= 4
    assert got["sglang"] == sorted(got["sglang"], key=lambda v: [int(p) for p in v.split(".")])


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
    pytest.param({"module": "vllm.x"}, r"unknown keys \['module'\]", id="unknown-key"),
    pytest.param({"stubs": {"raising": {"torch": ""}}}, r"give the reason", id="stub"),
])
def test_a_bad_lock_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(LockError, match=message):
        parse_lock({**_good(), **change}, LOCK_DIR / "vllm-0.33.0.json")


def test_an_unsupported_version_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedVersion, match=r"vllm 0\.30\.0 is not supported; supported: "
                                                 r"0\.10\.2, .*0\.33\.0"):
        find_lock("vllm", "0.30.0")
    with pytest.raises(UnsupportedVersion, match=r"no adapter for 'trtllm'"):
        find_lock("trtllm", "1.2.1")


def test_the_unified_tree_installs_sglangs_own_wheel_with_its_pools_real() -> None:
    """sglang_unified drives UnifiedRadixCache: the same wheel as sglang's lock, pip asked
    for `sglang==`, its own venv, and the device pools and metrics real (never stubbed:
    the tree's import chain and SGLang's scheduler code need them), only torchvision
    raising and primed; from 0.5.22 sglang's own lock is the same (its scheduler code
    runs on those pools)."""
    unified, radix = find_lock("sglang_unified", "0.5.23"), find_lock("sglang", "0.5.23")
    assert unified.wheel == radix.wheel
    assert (unified.requirement, unified.spec) == ("sglang==0.5.23", "sglang_unified==0.5.23")
    assert unified.key != radix.key  # a venv of its own
    assert set(radix.deps) == set(unified.deps)
    for lock in (unified, radix, find_lock("sglang", "0.5.22")):
        assert set(lock.stubs.raising) == {"torchvision"}, lock.path
        assert lock.stubs.prime == ("torchvision",) and not lock.stubs.absent
