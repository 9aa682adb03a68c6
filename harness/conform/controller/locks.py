"""Lock files: every supported (engine, version), pinned (harness/conform/locks/*.json).

A lock names the engine's wheel and its sha256, the Python it was resolved for, every
pure-Python dependency its cache modules import, pinned (`name==version`, installed
`--no-deps`: what pip's resolver chose under the engine's own specifiers, minus the GPU
stack), and the stubs for what cannot run on a CPU (`harness.conform.stubs.StubSpec`).
torch is never in a lock: the engine's venv shares the CPU torch of the harness's
interpreter. A lock is data: `engine` selects an adapter from
`harness.conform.adapters.ADAPTERS`, the harness's own registry, and nothing in it names
code to import.

The supported versions are the lock files present; anything else is refused with the
list (`UnsupportedVersion`, exit 2 for `kvharness conform`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.conform.adapters import ADAPTERS
from harness.conform.stubs import StubSpec
from harness.data_files import load_json

LOCK_DIR = Path(__file__).parents[1] / "locks"
# an engine whose adapter drives another cache class of the same package: its wheel and
# `pip download` name the package (every other engine is its own package)
DISTRIBUTIONS = {"sglang_unified": "sglang"}
# engines with a slot in the registry but no adapter that can run on this machine, and
# why: `kvharness conform` says so (exit 2). docs/conformance.md, "TensorRT-LLM", says
# what the adapter would wrap; it moves to ADAPTERS once a CUDA runner can host it.
NOT_RUNNABLE_HERE = {
    "tensorrt_llm": "TensorRT-LLM's wheels are not on the package registry (its sdist "
                    "fetches them from NVIDIA's index at build time) and its KVCacheManager "
                    "builds CUDA objects (a stream, device pools) when constructed; "
                    "docs/conformance.md says what its adapter would wrap"}
_KEYS = {"engine", "version", "python", "wheel", "deps", "stubs", "notes"}
_VERSION = re.compile(r"[0-9]+(\.[0-9]+){1,2}")
_PIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9A-Za-z.+!-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# never pinned: the harness's interpreter provides torch; these are CUDA builds
_NEVER = re.compile(r"(torch|torchvision|torchaudio|nvidia-[a-z0-9-]+|flashinfer-python)$",
                    re.IGNORECASE)


def distribution(engine: str) -> str:
    """The package `engine` is installed from (its own name but for DISTRIBUTIONS)."""
    return DISTRIBUTIONS.get(engine, engine)


class LockError(ValueError):
    """A lock file is malformed; the message names the file and the field."""


class UnsupportedVersion(ValueError):
    """No lock file for the engine or version asked for; the message lists what is."""


@dataclass(frozen=True)
class Wheel:
    """The engine's wheel: its file name (as the registry serves it), sha256 and size."""

    file: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Lock:
    """One supported engine version (see the module docstring)."""

    engine: str
    version: str
    python: str
    wheel: Wheel
    deps: tuple[str, ...]
    stubs: StubSpec
    notes: tuple[str, ...]
    path: Path

    @property
    def spec(self) -> str:
        """`engine==version`."""
        return f"{self.engine}=={self.version}"

    @property
    def requirement(self) -> str:
        """`package==version`: what pip downloads (`distribution`)."""
        return f"{distribution(self.engine)}=={self.version}"

    @property
    def key(self) -> str:
        """`engine-version` (the lock file's and the cache folder's name)."""
        return f"{self.engine}-{self.version}"


def parse_lock(data: Any, path: Path) -> Lock:
    """Validate a lock's JSON; LockError naming `path` and the field."""
    where = str(path)

    def bad(field: str, problem: str) -> LockError:
        return LockError(f"{where}: {field}: {problem}")

    if not isinstance(data, dict):
        raise LockError(f"{where}: expected an object, got {type(data).__name__}")
    unknown, missing = sorted(set(data) - _KEYS), sorted(_KEYS - {"notes"} - set(data))
    if unknown or missing:
        raise LockError(f"{where}: unknown keys {unknown}, missing keys {missing}")
    engine, version = data["engine"], data["version"]
    if engine not in ADAPTERS:
        raise bad("engine", f"{engine!r} has no adapter; known: {sorted(ADAPTERS)}")
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        raise bad("version", f"{version!r} is not a release number")
    if path.name != f"{engine}-{version}.json":
        raise bad("file name", f"should be {engine}-{version}.json")
    python = data["python"]
    if not isinstance(python, str) or not re.fullmatch(r"3\.[0-9]+", python):
        raise bad("python", f"{python!r} is not a Python version like '3.11'")
    wheel = data["wheel"]
    if not isinstance(wheel, dict) or set(wheel) != {"file", "sha256", "bytes"}:
        raise bad("wheel", "expected {file, sha256, bytes}")
    name, package = wheel["file"], distribution(engine)
    if not isinstance(name, str) or not name.startswith(f"{package}-{version}-") \
            or not name.endswith(".whl") or "/" in name:
        raise bad("wheel.file", f"{name!r} is not {package}-{version}-*.whl")
    if not isinstance(wheel["sha256"], str) or not _SHA256.fullmatch(wheel["sha256"]):
        raise bad("wheel.sha256", "expected 64 lowercase hex digits")
    size = wheel["bytes"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise bad("wheel.bytes", f"{size!r} is not a size")
    deps = data["deps"]
    if not isinstance(deps, list):
        raise bad("deps", "expected a list of name==version pins")
    for pin in deps:
        if not isinstance(pin, str) or not _PIN.fullmatch(pin):
            raise bad("deps", f"{pin!r} is not a name==version pin")
        if _NEVER.match(pin.split("==")[0]):
            raise bad("deps", f"{pin!r}: torch comes from the harness's interpreter and "
                              "CUDA builds never go into an engine's venv")
    names = [p.split("==")[0].lower().replace("_", "-") for p in deps]
    if len(set(names)) != len(names):
        raise bad("deps", "a package is pinned twice")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise bad("notes", "expected a list of strings")
    try:
        stubs = StubSpec.from_dict(data["stubs"], f"{where}: stubs")
    except ValueError as exc:
        raise LockError(str(exc)) from None
    return Lock(engine, version, python, Wheel(name, wheel["sha256"], size), tuple(deps),
                stubs, tuple(notes), path)


def load_lock(path: Path) -> Lock:
    """Read and validate one lock file."""
    return parse_lock(load_json(path, "lock file", LockError), path)


def supported(lock_dir: Path = LOCK_DIR) -> dict[str, list[str]]:
    """engine -> its supported versions, oldest first (one per lock file)."""
    out: dict[str, list[str]] = {engine: [] for engine in ADAPTERS}
    for path in lock_dir.glob("*.json"):
        engine, _, version = path.stem.partition("-")
        if engine in out:
            out[engine].append(version)
    for versions in out.values():
        versions.sort(key=lambda v: tuple(int(p) for p in v.split(".")))
    return out


def pinned(lock_dir: Path = LOCK_DIR) -> list[Lock]:
    """The lock of each engine's newest supported release, in `ADAPTERS` order: the
    releases the harness is held to (the smoke and full runs, `nox -s bench`'s table)."""
    return [find_lock(engine, versions[-1], lock_dir)
            for engine, versions in supported(lock_dir).items() if versions]


def find_lock(engine: str, version: str, lock_dir: Path = LOCK_DIR) -> Lock:
    """The lock of `engine==version`; UnsupportedVersion naming the supported ones."""
    versions = supported(lock_dir)
    if engine not in versions:
        raise UnsupportedVersion(f"no adapter for {engine!r}; engines: "
                                 f"{', '.join(sorted(versions))} (and kvcache)")
    if version not in versions[engine]:
        raise UnsupportedVersion(f"{engine} {version} is not supported; supported: "
                                 f"{', '.join(versions[engine])}")
    return load_lock(lock_dir / f"{engine}-{version}.json")
