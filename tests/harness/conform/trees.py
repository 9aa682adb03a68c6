"""A source tree of a locked release, for `kvharness conform vllm@PATH` tests: vLLM 0.33.0's
package as its wheel installs it (copied from the release's cached venv), its Python
files only (no compiled parts, as in a checkout), with or without one planted bug."""

from __future__ import annotations

import shutil
from pathlib import Path

from harness.conform.controller import install
from harness.conform.controller.locks import find_lock

RELEASE = "vllm==0.33.0"
# vLLM leaves the LoRA out of every block's extra keys: two LoRAs share KV, which
# `scope_isolation`'s count oracle must flag
PLANTED = ("vllm/v1/core/kv_cache_utils.py",
           "    lora_request = request.lora_request\n    if not lora_request:\n        return []\n",
           "    return []\n")


def release_package() -> Path | None:
    """The installed package of RELEASE in the engine cache, or None."""
    engine, version = RELEASE.split("==")
    env = install.installed(find_lock(engine, version))
    if env is None:
        return None
    found = sorted(env.root.glob(f"venv/lib/python*/site-packages/{engine}"))
    return found[0] if found else None


def missing_venvs() -> str | None:
    """Why the tree tests cannot run from the cache (the commands that fill it), or None."""
    engine, version = RELEASE.split("==")
    lock = find_lock(engine, version)
    if release_package() is None or install.installed(lock, engine_wheel=False) is None:
        return (f"{RELEASE} and its pins-only venv are not both in {install.cache_dir()} "
                f"(`kvharness conform {RELEASE}` then `kvharness conform {engine}@TREE` "
                "install them)")
    return None


def make_tree(folder: Path, planted: bool) -> Path:
    """A copy of the release's package under `folder` (its .py files and their cached
    bytecode, which stays valid: modification times are kept), the bug planted or not."""
    package = release_package()
    assert package is not None

    def skip(_: str, names: list[str]) -> set[str]:
        return {n for n in names if n.endswith((".so", ".cu", ".cuh"))}

    shutil.copytree(package, folder / package.name, ignore=skip)
    if planted:
        file, old, new = PLANTED
        text = (folder / file).read_text(encoding="utf-8")
        assert text.count(old) == 1, f"{file} no longer has the line to plant the bug in"
        (folder / file).write_text(text.replace(old, new), encoding="utf-8")
    return folder
