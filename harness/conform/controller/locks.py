"""Lock files: every supported (engine, version), pinned (harness/conform/locks/*.json).

A lock names the engine's wheel and its sha256, the Python it was resolved for, every
pure-Python dependency its cache modules import, pinned (`name==version`, installed
`--no-deps`: what pip's resolver chose under the engine's own specifiers, minus the GPU
stack), and the stubs for what cannot run on a CPU (`harness.conform.stubs.StubSpec`).
torch is never in a lock: the engine's venv shares the CPU torch of the harness's
interpreter. A lock is data: `engine` selects an adapter from
`harness.conform.adapters.ADAPTERS`, the harness's own registry, and nothing in it names
code to import.

The committed locks are `LOCK_DIR/<engine>-<version>.json`, resolved for the project's
Python (`DEFAULT_PYTHON`), or `<engine>-<version>-py<X.Y>.json` for another Python. A
release without one is resolved at first use (`harness.conform.controller.resolve`) into
the engine cache's `locks/` folder, in the same form, with `resolved` saying how;
`kvharness conform lock SPEC` copies it here for committing. `find_lock` looks in both, committed
first; `nearest_lock` names the committed lock a new release starts from.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.conform.adapters import ADAPTERS
from harness.conform.stubs import StubSpec
from harness.conform.versions import VERSION_PATTERN, nearest, parse_version, sort_versions
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
DEFAULT_PYTHON = "3.11"  # the Python of the locks named without a -py suffix
_KEYS = {"engine", "version", "python", "wheel", "deps", "stubs", "notes", "resolved"}
_OPTIONAL = {"notes", "resolved"}
_RESOLVED_KEYS = {"base", "python", "pip", "date", "added", "how"}
_VERSION = re.compile(VERSION_PATTERN)
_PIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9A-Za-z.+!-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# never pinned: the harness's interpreter provides torch; these are CUDA builds
_NEVER = re.compile(r"(torch|torchvision|torchaudio|nvidia-[a-z0-9-]+|flashinfer-python)$",
                    re.IGNORECASE)


def never_pinned(name: str) -> bool:
    """Whether a distribution never goes into a lock: torch (the harness's interpreter
    provides it) and the CUDA stack."""
    return _NEVER.match(name) is not None


def distribution(engine: str) -> str:
    """The package `engine` is installed from (its own name but for DISTRIBUTIONS)."""
    return DISTRIBUTIONS.get(engine, engine)


class LockError(ValueError):
    """A lock file is malformed; the message names the file and the field."""


class UnsupportedVersion(ValueError):
    """No lock file for the engine or version asked for; the message lists what is."""


def python_tag() -> str:
    """This interpreter's `major.minor`, as a lock records it."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def lock_name(engine: str, version: str, python: str) -> str:
    """The file name of `engine==version`'s lock for `python` (module docstring)."""
    suffix = "" if python == DEFAULT_PYTHON else f"-py{python}"
    return f"{engine}-{version}{suffix}.json"


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
    resolved: dict[str, Any] | None = None  # how the lock was made, when not by hand

    @property
    def committed(self) -> bool:
        """Whether the lock is one of the repository's (not resolved into the cache)."""
        return self.path.parent.resolve() == LOCK_DIR.resolve()

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
    unknown, missing = sorted(set(data) - _KEYS), sorted(_KEYS - _OPTIONAL - set(data))
    if unknown or missing:
        raise LockError(f"{where}: unknown keys {unknown}, missing keys {missing}")
    engine, version = data["engine"], data["version"]
    if engine not in ADAPTERS:
        raise bad("engine", f"{engine!r} has no adapter; known: {sorted(ADAPTERS)}")
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        raise bad("version", f"{version!r} is not a version like 0.33.0 or 0.5.6.post2")
    python = data["python"]
    if not isinstance(python, str) or not re.fullmatch(r"3\.[0-9]+", python):
        raise bad("python", f"{python!r} is not a Python version like '3.11'")
    if path.name != lock_name(engine, version, python):
        raise bad("file name", f"should be {lock_name(engine, version, python)}")
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
        if never_pinned(pin.split("==")[0]):
            raise bad("deps", f"{pin!r}: torch comes from the harness's interpreter and "
                              "CUDA builds never go into an engine's venv")
    names = [p.split("==")[0].lower().replace("_", "-") for p in deps]
    if len(set(names)) != len(names):
        raise bad("deps", "a package is pinned twice")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise bad("notes", "expected a list of strings")
    resolved = data.get("resolved")
    if resolved is not None and (not isinstance(resolved, dict)
                                 or not set(resolved) <= _RESOLVED_KEYS):
        raise bad("resolved", f"expected an object with keys among {sorted(_RESOLVED_KEYS)}")
    try:
        stubs = StubSpec.from_dict(data["stubs"], f"{where}: stubs")
    except ValueError as exc:
        raise LockError(str(exc)) from None
    return Lock(engine, version, python, Wheel(name, wheel["sha256"], size), tuple(deps),
                stubs, tuple(notes), path, resolved)


def lock_data(lock: Lock) -> dict[str, Any]:
    """`lock` as its file holds it (`parse_lock` reads it back)."""
    out: dict[str, Any] = {
        "engine": lock.engine, "version": lock.version, "python": lock.python,
        "wheel": {"file": lock.wheel.file, "sha256": lock.wheel.sha256,
                  "bytes": lock.wheel.bytes},
        "deps": list(lock.deps), "stubs": lock.stubs.as_dict(), "notes": list(lock.notes)}
    if lock.resolved is not None:
        out["resolved"] = lock.resolved
    return out


def load_lock(path: Path) -> Lock:
    """Read and validate one lock file."""
    return parse_lock(load_json(path, "lock file", LockError), path)


def _locks_in(lock_dir: Path, python: str) -> dict[str, dict[str, Path]]:
    """engine -> version -> the lock file for `python` in `lock_dir`."""
    out: dict[str, dict[str, Path]] = {engine: {} for engine in ADAPTERS}
    for path in lock_dir.glob("*.json"):
        engine, _, rest = path.stem.partition("-")
        version, _, tag = rest.partition("-py")
        if engine in out and (tag or DEFAULT_PYTHON) == python and _VERSION.fullmatch(version):
            out[engine][version] = path
    return out


def supported(lock_dir: Path = LOCK_DIR, python: str | None = None) -> dict[str, list[str]]:
    """engine -> the versions committed in `lock_dir` for `python` (this interpreter's
    by default), oldest first (one per lock file)."""
    found = _locks_in(lock_dir, python or python_tag())
    return {engine: sort_versions(versions) for engine, versions in found.items()}


def pinned(lock_dir: Path = LOCK_DIR) -> list[Lock]:
    """The lock of each engine's newest release committed for this interpreter's Python,
    in `ADAPTERS` order: the releases the harness is held to (the smoke and full runs,
    `nox -s bench`'s table)."""
    return [find_lock(engine, versions[-1], lock_dir)
            for engine, versions in supported(lock_dir).items() if versions]


def base_of(engine: str, base: str | None) -> str:
    """The lock a resolved lock of `engine` started from, as `ENGINE VERSION`: its
    `resolved.base` is a version of `engine`, or `ENGINE==VERSION` where it started from
    another engine's lock of the same package (`nearest_lock`); "?" where none is said."""
    if not base:
        return "?"
    other, sep, version = base.partition("==")
    return f"{other} {version}" if sep else f"{engine} {base}"


def nearest_lock(engine: str, version: str, lock_dir: Path = LOCK_DIR) -> Lock | None:
    """The committed lock a release without one starts from (`versions.nearest`), for
    any Python (this interpreter's first); None when the engine has none. An engine
    that installs another's package (`DISTRIBUTIONS`: `sglang_unified` is `sglang`'s
    wheel) starts from that engine's lock of the very same release where there is one
    (the same wheel: its pins and stubs), before its own nearest release."""
    siblings = [e for e in ADAPTERS if e != engine and distribution(e) == distribution(engine)]
    for python in dict.fromkeys((python_tag(), DEFAULT_PYTHON)):
        locks = _locks_in(lock_dir, python)
        found = locks.get(engine, {})
        if version not in found:
            for sibling in siblings:
                if version in locks.get(sibling, {}):
                    return load_lock(locks[sibling][version])
        near = nearest(version, found)
        if near is not None:
            return load_lock(found[near])
    return None


def find_lock(engine: str, version: str, lock_dir: Path = LOCK_DIR,
              resolved_dir: Path | None = None) -> Lock:
    """The lock of `engine==version` for this interpreter: committed in `lock_dir`, else
    resolved at first use in `resolved_dir`. UnsupportedVersion naming the committed
    ones and the command that resolves it otherwise."""
    if engine not in ADAPTERS:
        raise UnsupportedVersion(f"no adapter for {engine!r}; engines: "
                                 f"{', '.join(sorted(ADAPTERS))} (and kvcache)")
    parse_version(version)  # ValueError naming it
    python = python_tag()
    for folder in (lock_dir, resolved_dir):
        if folder is not None and (folder / lock_name(engine, version, python)).exists():
            return load_lock(folder / lock_name(engine, version, python))
    versions, mine = supported(lock_dir, python)[engine], ""
    if not versions and python != DEFAULT_PYTHON:
        versions, mine = supported(lock_dir, DEFAULT_PYTHON)[engine], f" for {DEFAULT_PYTHON}"
    raise UnsupportedVersion(
        f"{engine} {version} has no lock for Python {python}; committed{mine}: "
        f"{', '.join(versions) or 'none'}. `kvharness conform {engine}=={version}` "
        f"resolves one at first use; `kvharness conform lock {engine}=={version}` writes "
        f"it into {lock_dir} for committing")
