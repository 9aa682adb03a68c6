"""An engine's own cached virtual environment, built from its lock without the GPU stack.

Per (engine, version), under `cache_dir()` (`~/.cache/kvharness/engines`, or
`$KVHARNESS_ENGINE_CACHE`):

    wheels/<wheel file>            downloaded once, checked against the lock's sha256
    torch-<version>-<digest>/      links to the harness interpreter's CPU torch, numpy
                                   and torch's own requirements (one per interpreter)
    <engine>-<version>/venv        python -m venv (no system site-packages: the
                                   interpreter's other packages would leak in), with a
                                   .pth line naming the torch folder
    <engine>-<version>/stamp.json  what the venv was built from; any change rebuilds it
    <engine>-<version>/install.log pip's output
    <engine>-<version>-deps/       the same without the engine's wheel, for a source tree
                                   (its package is imported from where it is)
    locks/                         locks resolved at first use
                                   (harness.conform.controller.resolve)

Everything goes in `--no-deps`: the wheel and the lock's pins, from the package registry
(pip's own configuration and cache apply; `PIP_FIND_LINKS` points it at local wheels).
torch is never installed: SGLang's metadata pins torch 2.14.1 and CUDA wheels, and the
engine's cache path runs on the CPU torch the harness already has. A second run finds
the stamp and installs nothing. Concurrent runs of one version wait on a file lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.conform.controller.locks import Lock

CACHE_ENV = "KVHARNESS_ENGINE_CACHE"
LAYOUT = 1  # bump when the venv layout changes: every stamp then rebuilds
_SHARED_ROOTS = ("torch", "numpy")  # with torch's requirements, linked from the interpreter


class InstallError(RuntimeError):
    """The engine could not be installed; the message says which step and why."""


@dataclass(frozen=True)
class EngineEnv:
    """An installed engine: its venv's interpreter, folder, and how it came to be."""

    python: Path
    root: Path
    reused: bool
    seconds: float


def cache_dir() -> Path:
    """Where engines are installed: $KVHARNESS_ENGINE_CACHE or ~/.cache/kvharness/engines."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvharness" / "engines"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _site_packages(venv: Path) -> Path:
    tag = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / tag / "site-packages"


def torch_version() -> str:
    """This interpreter's torch version (shared with every engine venv); InstallError
    when it has none."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise InstallError(f"this interpreter ({sys.executable}, Python "
                           f"{sys.version.split()[0]}) has no torch to share with the engine's "
                           "venv: install a CPU build of torch for it first (see "
                           "docs/conformance.md, 'Python 3.11 and 3.12')") from None


def stamp(lock: Lock) -> dict[str, str]:
    """What a venv is built from: the lock file, the interpreter (its environment's
    prefix: `bin/python` and `bin/python3` of one venv are one interpreter), its torch,
    the layout."""
    return {"lock_sha256": hashlib.sha256(lock.path.read_bytes()).hexdigest(),
            "python": sys.version.split()[0], "prefix": sys.prefix,
            "torch": torch_version(), "layout": str(LAYOUT)}


def home_name(lock: Lock, engine_wheel: bool = True) -> str:
    """The venv folder's name under the cache: `lock.key`, `-deps` without the wheel."""
    return lock.key if engine_wheel else f"{lock.key}-deps"


def installed(lock: Lock, root: Path | None = None, engine_wheel: bool = True
              ) -> EngineEnv | None:
    """The cached install of `lock` (without the engine's wheel where `engine_wheel` is
    False) if its stamp is current (changes nothing), else None."""
    home = (root or cache_dir()) / home_name(lock, engine_wheel)
    try:
        recorded = json.loads((home / "stamp.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    python = _venv_python(home / "venv")
    if recorded.get("stamp") != stamp(lock) or not python.exists():
        return None
    return EngineEnv(python, home, True, 0.0)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created) for the block: one builder at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure(lock: Lock, say: Callable[[str], None] = print, root: Path | None = None,
           engine_wheel: bool = True) -> EngineEnv:
    """The cached install of `lock` (its pins only where `engine_wheel` is False: a
    source tree's venv), built first when missing or stale (mutates the cache). Raises
    InstallError naming the step that failed."""
    base = root or cache_dir()
    name = home_name(lock, engine_wheel)
    with file_lock(base / f"{name}.lock"):
        found = installed(lock, base, engine_wheel)
        if found is not None:
            return found
        start = time.perf_counter()
        _build(lock, base, name, engine_wheel, say)
        env = installed(lock, base, engine_wheel)
        assert env is not None  # _build wrote the stamp
        return EngineEnv(env.python, env.root, False, time.perf_counter() - start)


def _build(lock: Lock, base: Path, name: str, engine_wheel: bool,
           say: Callable[[str], None]) -> None:
    check_python(lock)
    home = base / name
    log = make_home(home)
    what = lock.spec if engine_wheel else f"{lock.spec}'s pinned dependencies"
    say(f"installing {what} into {home} (once; later runs reuse it)")
    python = make_venv(home, base, log)
    wheel = [str(_wheel(lock, base, log, say))] if engine_wheel else []
    say(f"  {lock.wheel.file if engine_wheel else 'no wheel'} and {len(lock.deps)} "
        "pinned dependencies, --no-deps")
    pip_install(python, wheel, lock.deps, log)
    write_stamp(lock, home)


def check_python(lock: Lock) -> None:
    """InstallError unless `lock` was resolved for this interpreter's Python."""
    want = tuple(int(p) for p in lock.python.split("."))
    if sys.version_info[:2] != want:
        raise InstallError(f"{lock.spec} is locked for Python {lock.python} (its wheels and "
                           f"pins), this is {sys.version.split()[0]}")


def make_home(home: Path) -> Path:
    """An empty `home` (whatever was there is removed); returns its install.log."""
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    return home / "install.log"


def make_venv(home: Path, base: Path, log: Path) -> Path:
    """`home/venv` without pip, seeing this interpreter's torch through a .pth line;
    returns its interpreter. InstallError when `python -m venv` fails."""
    shared = _shared_torch(base)
    run_logged([sys.executable, "-m", "venv", "--without-pip", str(home / "venv")], log, "venv")
    site = _site_packages(home / "venv")
    (site / "_kvharness_torch.pth").write_text(f"{shared}\n", encoding="utf-8")
    return _venv_python(home / "venv")


def pip_install(python: Path, files: list[str], pins: tuple[str, ...] | list[str],
                log: Path) -> None:
    """`pip install --no-deps` of `files` and `pins` into `python`'s venv (pip's own
    configuration and cache apply). InstallError with the end of `log` on failure."""
    requirements = log.parent / "requirements.txt"
    requirements.write_text("\n".join(pins) + "\n", encoding="utf-8")
    run_logged([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-compile", "--disable-pip-version-check", *files, "-r", str(requirements)],
         log, "pip install")


def write_stamp(lock: Lock, home: Path) -> None:
    """Record that `home`'s venv is built from `lock` (`installed` then finds it)."""
    record = {"stamp": stamp(lock), "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "shared_torch": str(_shared_torch(home.parent))}
    (home / "stamp.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def run_logged(argv: list[str], log: Path, step: str) -> None:
    """Run `argv` with its output appended to `log`; InstallError naming `step` and
    quoting the end of the log when it fails."""
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-12:]
        raise InstallError(f"{step} failed (exit {done.returncode}); the end of {log}:\n"
                           + "\n".join(tail))


def sha256_of(path: Path) -> str:
    """The file's sha256, as hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _wheel(lock: Lock, base: Path, log: Path, say: Callable[[str], None]) -> Path:
    """The engine's wheel in the cache, downloaded when missing; its sha256 checked."""
    folder = base / "wheels"
    path = folder / lock.wheel.file
    if not path.exists():
        say(f"  downloading {lock.wheel.file} ({lock.wheel.bytes / 1e6:.0f} MB)")
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
              "--disable-pip-version-check", "--dest", str(folder), lock.requirement], log,
             "download")
    if not path.exists():
        raise InstallError(f"pip download of {lock.requirement} did not produce {lock.wheel.file} "
                           f"(see {log})")
    got = sha256_of(path)
    if got != lock.wheel.sha256:
        path.unlink()
        raise InstallError(f"{lock.wheel.file}: sha256 {got}, the lock says "
                           f"{lock.wheel.sha256}; the file was removed")
    return path


def _shared_torch(base: Path) -> Path:
    """A folder of links to this interpreter's torch, numpy and torch's requirements
    (their packages and dist-info), built once per interpreter and torch."""
    site = Path(sysconfig.get_paths()["purelib"])
    digest = hashlib.sha256(f"{sys.prefix}|{site}".encode()).hexdigest()[:12]
    folder = base / f"torch-{torch_version()}-{digest}"
    if (folder / ".complete").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for dist in _closure(_SHARED_ROOTS):
        for top in _top_levels(dist):
            link = folder / top.name
            if not link.exists():
                link.symlink_to(top)
    (folder / ".complete").write_text("", encoding="utf-8")
    return folder


def _closure(roots: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """The distributions `roots` need (no extras), as installed here."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop().strip(), maxsplit=1)[0].lower()
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional requirement this interpreter does without
        seen[name] = dist
        todo += [r for r in dist.requires or () if "extra ==" not in r]
    return list(seen.values())


def _top_levels(dist: importlib.metadata.Distribution) -> list[Path]:
    """The top-level files and folders a distribution installed into site-packages."""
    tops: set[Path] = set()
    for file in dist.files or ():
        parts = Path(file).parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith(".pth"):
            continue
        tops.add(Path(str(dist.locate_file(parts[0]))))
    return sorted(t for t in tops if t.exists())
