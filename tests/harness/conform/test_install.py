"""The engine cache: where it lives, when a venv counts as installed, the wheel's sha256,
and the shared CPU torch (no download, no engine)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from harness.conform.controller import install
from harness.conform.controller.locks import find_lock


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv(install.CACHE_ENV, str(tmp_path / "engines"))
    assert install.cache_dir() == tmp_path / "engines"
    monkeypatch.delenv(install.CACHE_ENV)
    assert install.cache_dir() == Path.home() / ".cache" / "kvharness" / "engines"


def test_a_venv_counts_only_with_a_current_stamp(tmp_path: Path) -> None:
    lock = find_lock("vllm", "0.33.0")
    home = tmp_path / lock.key
    python = home / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    assert install.installed(lock, tmp_path) is None  # no stamp yet
    stamp = {"stamp": install.stamp(lock)}
    (home / "stamp.json").write_text(json.dumps(stamp))
    found = install.installed(lock, tmp_path)
    assert found is not None and found.python == python and found.reused
    stamp["stamp"]["torch"] = "0.0.1"  # another interpreter's torch: rebuild
    (home / "stamp.json").write_text(json.dumps(stamp))
    assert install.installed(lock, tmp_path) is None


def test_a_wheel_whose_sha256_differs_is_removed(tmp_path: Path) -> None:
    lock = find_lock("vllm", "0.33.0")
    (tmp_path / "wheels").mkdir()
    wheel = tmp_path / "wheels" / lock.wheel.file
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(install.InstallError, match=r"sha256 [0-9a-f]{64}, the lock says "
                                                   + lock.wheel.sha256):
        install._wheel(lock, tmp_path, tmp_path / "log", print)
    assert not wheel.exists()


def test_a_lock_for_another_python_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    lock = dataclasses.replace(find_lock("vllm", "0.33.0"), python="3.9")
    with pytest.raises(install.InstallError, match=r"locked for Python 3\.9"):
        install.ensure(lock, print, tmp_path)
    assert not (tmp_path / lock.key).exists()


def test_the_shared_torch_links_this_interpreters_packages(tmp_path: Path) -> None:
    folder = install._shared_torch(tmp_path)
    for name in ("torch", "numpy", "sympy", "filelock"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        want = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
        assert (folder / want.name).resolve() == want.resolve()
    assert any(p.name.startswith("torch-") and p.name.endswith(".dist-info")
               for p in folder.iterdir())
    assert install._shared_torch(tmp_path) == folder  # built once

