"""A lock for a release that has none, made from its wheel and its own metadata.

The procedure the committed locks were made by, as code (`resolve`):

1. start from the nearest committed lock (`locks.nearest_lock`; for an engine that
   installs another's package, that engine's lock of the same release where there is
   one, named in `resolved.base` as ENGINE==VERSION): its pinned names are the cache
   modules' import closure as it was, its stubs what could not run on a CPU;
2. download the release's wheel into the engine cache (`<cache>/wheels`, kept) and read
   its METADATA: Requires-Python must admit this interpreter, and each name of the
   closure takes the engine's own specifier for it where it gives one (`requirements`);
3. ask pip's resolver (`pip install --dry-run --report`, in a venv that sees the
   harness's CPU torch, so torch and what it brings count as installed) which versions it
   would install for them; everything it names is pinned, but torch and the CUDA stack
   (`locks.parse_lock` refuses those);
4. install the wheel and the pins `--no-deps` into the release's venv and prove the lock
   by the worker's own load and self-test: the cache modules import under the stubs
   and every engine function the adapter calls is the engine's own. A module the import
   asks for and does not find is stubbed as the engine's nearest lock that stubs it does
   (`borrowed_stub`: a GPU package such as sgl_kernel is never installed), else added by
   name (`module_distribution`: the engine's requirement of that name, else a known
   module -> distribution pair, else the module's own name) and the closure resolved
   again; a name imported at module level from a raising stub joins that stub's names. Nothing else is guessed: any other failure
   ends the resolution, naming it and what to write by hand.

The lock records how it was made (`resolved`: the base lock, the Python, pip's version,
the date, what was added) and is written into `<cache>/locks/` (`resolved_dir`); the
release's venv is the one it was proven in. `kvharness conform lock SPEC` copies it into
`harness/conform/locks/` for committing.
"""

from __future__ import annotations

import email.parser
import json
import re
import shutil
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.conform.adapters import ADAPTERS
from harness.conform.controller import install
from harness.conform.controller.locks import (
    LOCK_DIR,
    Lock,
    LockError,
    Wheel,
    distribution,
    find_lock,
    load_lock,
    lock_data,
    lock_name,
    nearest_lock,
    never_pinned,
    parse_lock,
    python_tag,
    supported,
)
from harness.conform.controller.remote import WorkerError, WorkerTarget
from harness.conform.stubs import StubSpec
from harness.conform.versions import parse_version

Say = Callable[[str], None]
MAX_ROUNDS = 12  # missing modules added one a round; a closure needing more is refused
# an import name -> its distribution, where they differ and the engine does not say
MODULE_DISTRIBUTIONS = {
    "PIL": "pillow", "yaml": "PyYAML", "zmq": "pyzmq", "google": "protobuf",
    "cv2": "opencv-python-headless", "cpuinfo": "py-cpuinfo", "attr": "attrs",
    "dateutil": "python-dateutil", "tvm_ffi": "apache-tvm-ffi", "jwt": "PyJWT",
    "sklearn": "scikit-learn", "multipart": "python-multipart", "dotenv": "python-dotenv",
    "openai_harmony": "openai-harmony", "pkg_resources": "setuptools"}
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([A-Za-z0-9_.]+)'")
_STUB_NAME = re.compile(r"StubUsedError: ([A-Za-z0-9_.]+)\.([A-Za-z_][A-Za-z0-9_]*): "
                        r"\1 is a stub")
_SAVED = re.compile(r"(?:Saved|File was already downloaded) (\S+\.whl)")


class ResolveError(RuntimeError):
    """No lock could be made; the message says which step failed and what would fix it."""


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(metadata: str) -> dict[str, list[str]]:
    """The wheel METADATA's requirements outside any extra, by normalised name: each a
    requirement line for pip (extras dropped, markers kept: pip evaluates them)."""
    out: dict[str, list[str]] = {}
    for line in email.parser.Parser().parsestr(metadata).get_all("Requires-Dist") or ():
        requirement, _, marker = line.partition(";")
        if "extra" in marker:
            continue
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)", requirement)
        if m is None:
            continue
        spec = m[3].strip().strip("()")
        text = f"{m[1]}{spec}" + (f" ; {marker.strip()}" if marker.strip() else "")
        out.setdefault(normalise(m[1]), []).append(text)
    return out


def requires_python(metadata: str) -> str | None:
    """The METADATA's Requires-Python specifier, if any."""
    return email.parser.Parser().parsestr(metadata).get("Requires-Python")


def admits(specifier: str | None, python: str) -> bool:
    """Whether a Requires-Python specifier (`>=3.10,<3.14`) admits `python` (`3.12`);
    clauses other than comparisons of release numbers are taken as admitting."""
    if not specifier:
        return True
    have = tuple(int(p) for p in python.split("."))
    for clause in specifier.split(","):
        m = re.fullmatch(r"\s*(>=|<=|==|!=|>|<|~=)\s*([0-9]+(?:\.[0-9]+)*)(\.\*)?\s*", clause)
        if m is None:
            continue
        want = tuple(int(p) for p in m[2].split("."))
        mine = have[:len(want)] if m[3] or m[1] in ("==", "!=") else have
        ok = {">=": mine >= want, "<=": mine <= want, ">": mine > want, "<": mine < want,
              "==": mine == want, "!=": mine != want,
              "~=": mine >= want and mine[:len(want) - 1] == want[:-1]}[m[1]]
        if not ok:
            return False
    return True


def module_distribution(module: str, required: dict[str, list[str]]) -> str:
    """The distribution that provides top-level `module`: the engine's requirement of
    that name, else MODULE_DISTRIBUTIONS, else the module's own name."""
    top = module.split(".")[0]
    if normalise(top) in required:
        return normalise(top)
    return MODULE_DISTRIBUTIONS.get(top, top)


def request_lines(names: list[str], required: dict[str, list[str]]) -> list[str]:
    """What pip's resolver is asked for: each name with the engine's own specifier where
    the METADATA gives one, else bare."""
    out: list[str] = []
    for name in names:
        out += required.get(normalise(name), [name])
    return out


def pins_from_report(report: dict[str, Any], never: Callable[[str], bool]) -> list[str]:
    """`name==version` of every distribution pip's `--report` would install, sorted by
    name, but those `never` refuses (torch, the CUDA stack)."""
    pins = []
    for item in report.get("install", ()):
        meta = item.get("metadata", {})
        name, version = meta.get("name"), meta.get("version")
        if isinstance(name, str) and isinstance(version, str) and not never(name):
            pins.append(f"{name}=={version}")
    return sorted(pins, key=lambda p: normalise(p.split("==")[0]))


def download_wheel(engine: str, version: str, base: Path, log: Path, say: Say) -> Path:
    """The release's wheel for this interpreter in `base/wheels` (downloaded once)."""
    folder = base / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    requirement = f"{distribution(engine)}=={version}"
    say(f"  downloading {requirement}'s wheel into {folder} (once)")
    before = log.read_text(encoding="utf-8") if log.exists() else ""
    try:
        install.run_logged([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--only-binary=:all:", "--disable-pip-version-check", "--dest",
                            str(folder), requirement], log, "download")
    except install.InstallError as exc:
        raise ResolveError(f"{requirement}: no wheel for this machine on the package "
                           f"registry ({exc}); `pip index versions {distribution(engine)}` "
                           "lists the releases it serves") from None
    found = _SAVED.findall(log.read_text(encoding="utf-8")[len(before):])
    if not found:
        raise ResolveError(f"pip download of {requirement} named no wheel (see {log})")
    path = Path(found[-1])
    return path if path.is_absolute() else folder / path.name


def read_metadata(wheel: Path) -> str:
    """The wheel's METADATA text."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist()
                 if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise ResolveError(f"{wheel.name}: expected one .dist-info/METADATA, found {names}")
        return archive.read(names[0]).decode("utf-8")


def pip_resolve(python: Path, lines: list[str], home: Path, log: Path) -> list[str]:
    """Pins for `lines` as pip's resolver chooses them for `python`'s venv."""
    request = home / "resolve-request.txt"
    report = home / "resolve-report.json"
    request.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        install.run_logged([sys.executable, "-m", "pip", "--python", str(python),
                            "install", "--dry-run", "--quiet", "--disable-pip-version-check",
                            "--report", str(report), "-r", str(request)], log, "pip resolve")
    except install.InstallError as exc:
        raise ResolveError(f"pip's resolver found no versions for the closure: {exc}") from None
    return pins_from_report(json.loads(report.read_text(encoding="utf-8")), never_pinned)


def _pip_version() -> str:
    from importlib.metadata import version

    return version("pip")


def resolve(engine: str, version: str, base: Path, say: Say = print,
            lock_dir: Path = LOCK_DIR) -> Lock:
    """Make, prove and write the lock of `engine==version` for this interpreter (see the
    module docstring); its venv is left built and stamped under `base`. Returns the lock
    (in `resolved_dir(base)`). ResolveError naming the failed step otherwise."""
    parsed = parse_version(version)
    if not parsed.is_release:
        raise ResolveError(f"{engine} {version} is not a registry release: run a checkout as "
                           f"{engine}@PATH, or the one installed here as a bare {engine}")
    start = nearest_lock(engine, version, lock_dir)
    if start is None:
        raise ResolveError(f"{engine} has no committed lock to start from: write one by hand "
                           "(docs/conformance.md, 'Adding an engine')")
    python = python_tag()
    install.torch_version()  # InstallError before any download when there is none to share
    home = base / f"{engine}-{version}"
    log = install.make_home(home)
    say(f"{engine} {version} has no lock: resolving one from its wheel and the nearest "
        f"lock ({start.engine} {start.version}, Python {start.python}); log in {log}")
    wheel = download_wheel(engine, version, base, log, say)
    metadata = read_metadata(wheel)
    wants = requires_python(metadata)
    if not admits(wants, python):
        raise ResolveError(f"{engine} {version} requires Python {wants}; this is {python}: "
                           "run the harness on a Python it admits")
    try:
        return _rounds(engine, version, python, wheel, requirements(metadata), start, home,
                       base, lock_dir, say)
    except (ResolveError, install.InstallError):
        # a venv without a stamp is never used: keep only the log the message points to
        for folder in (home / "venv", home / "resolver"):
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _rounds(engine: str, version: str, python: str, wheel: Path,
            required: dict[str, list[str]], start: Lock, home: Path, base: Path,
            lock_dir: Path, say: Say) -> Lock:
    """Steps 3 and 4 of the module docstring until the lock is proven (see `resolve`)."""
    log = home / "install.log"
    names = [p.split("==")[0] for p in start.deps]
    stubs, added = start.stubs, list[str]()
    venv = install.make_venv(home, base, log)
    # pip's resolver asks a venv of its own that never gets anything installed: in the
    # engine's venv every package of the previous round would count as satisfied
    clean = install.make_venv(home / "resolver", base, log)
    for _ in range(MAX_ROUNDS):
        pins = pip_resolve(clean, request_lines(names, required), home, log)
        say(f"  {wheel.name} and {len(pins)} pins from pip's resolver, --no-deps")
        install.pip_install(venv, [str(wheel)], pins, log)
        lock = _write(engine, version, python, wheel, pins, stubs, start, added, home)
        problem = _prove(lock, venv, home)
        if problem is None:  # only a proven lock goes where runs look for one
            final = resolved_dir(base) / lock.path.name
            final.parent.mkdir(parents=True, exist_ok=True)
            final.write_bytes(lock.path.read_bytes())
            lock = load_lock(final)
            install.write_stamp(lock, home)
            shutil.rmtree(home / "resolver", ignore_errors=True)
            say(f"  proven: the cache modules import and the self-test passes; lock in "
                f"{lock.path}")
            return lock
        names, stubs, what = next_round(problem, engine, version, names, stubs, required,
                                        start, lock_dir)
        added.append(what)
        say(f"  adding {added[-1]}")
    raise ResolveError(f"{engine} {version}: the closure still grew after {MAX_ROUNDS} "
                       f"rounds (added: {', '.join(added)})")


def next_round(problem: str, engine: str, version: str, names: list[str], stubs: StubSpec,
          required: dict[str, list[str]], start: Lock, lock_dir: Path
          ) -> tuple[list[str], StubSpec, str]:
    """The closure and stubs for the next round after the worker's `problem`, and what
    was added (module docstring, step 4). ResolveError when nothing reliable can be."""
    missing, stubbed = _MISSING.search(problem), _STUB_NAME.search(problem)
    module = missing[1] if missing else ""
    borrowed = borrowed_stub(engine, version, module, lock_dir) if missing else None
    if borrowed is not None:
        return names, merge_stubs(stubs, borrowed[0]), \
            f"stub {module.split('.')[0]} as {borrowed[1]}'s lock has it"
    if missing and module.split(".")[0] != distribution(engine):
        name = module_distribution(module, required)
        if normalise(name) in {normalise(n) for n in names}:
            raise ResolveError(f"the import still misses {module!r} with {name} "
                               f"installed:\n{problem}")
        return [*names, name], stubs, f"{name} (the import asked for {module})"
    if stubbed and _inside(stubbed[1], stubs.raising):
        return names, _with_name(stubs, stubbed[1], stubbed[2]), \
            f"stub name {stubbed[1]}.{stubbed[2]} (imported at module level)"
    if problem.startswith("selftest:"):  # it loaded: the adapter's calls do not fit
        raise ResolveError(
            f"{engine} {version} loads, but the adapter's probe of its API fails: the "
            f"adapter ({adapter_file(engine)}) needs to follow this release "
            f"before it can be locked:\n{problem}")
    raise ResolveError(
        f"{engine} {version} does not load with the stubs of {start.version}'s lock and "
        f"its closure; write its lock by hand (docs/conformance.md, 'Adding an engine'), "
        f"starting from {start.path}:\n{problem}")


def adapter_file(engine: str) -> str:
    """The file of the adapter `engine`'s worker loads (`ADAPTERS`, the registry: it need
    not be named for the engine), relative to the repository root."""
    return ADAPTERS[engine].replace(".", "/") + ".py"


def borrowed_stub(engine: str, version: str, module: str, lock_dir: Path = LOCK_DIR
                  ) -> tuple[StubSpec, str] | None:
    """The stubs for `module`'s top-level package in the committed lock of `engine`
    nearest `version` that stubs it (absent or raising, with its names, submodules and
    prime), and that lock's version; None when no lock stubs it."""
    top = module.split(".")[0]
    found = supported(lock_dir, python_tag())[engine] or supported(lock_dir)[engine]
    for candidate in sorted(found, key=lambda v: abs_distance(v, version)):
        stubs = find_lock(engine, candidate, lock_dir).stubs
        if top not in stubs.absent and top not in stubs.raising:
            continue

        def under(mapping: Any) -> dict[str, Any]:
            return {k: v for k, v in mapping.items() if _inside(k, [top])}

        return StubSpec(under(stubs.absent), under(stubs.raising), under(stubs.names),
                        tuple(p for p in stubs.prime if _inside(p, [top]))), candidate
    return None


def abs_distance(a: str, b: str) -> tuple[int, ...]:
    """How far apart two versions are, release part by part (for the nearest lock)."""
    x, y = parse_version(a).release, parse_version(b).release
    n = max(len(x), len(y))
    x, y = x + (0,) * (n - len(x)), y + (0,) * (n - len(y))
    return tuple(abs(i - j) for i, j in zip(x, y, strict=True))


def merge_stubs(stubs: StubSpec, more: StubSpec) -> StubSpec:
    """`stubs` with `more`'s entries added."""
    return StubSpec({**stubs.absent, **more.absent}, {**stubs.raising, **more.raising},
                    {**stubs.names, **more.names},
                    tuple(dict.fromkeys((*stubs.prime, *more.prime))))


def resolved_dir(base: Path) -> Path:
    """Where locks resolved at first use are kept: `<engine cache>/locks`."""
    return base / "locks"


def _inside(module: str, roots: Any) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def _with_name(stubs: StubSpec, module: str, name: str) -> StubSpec:
    names = {k: tuple(v) for k, v in stubs.names.items()}
    names[module] = tuple(sorted({*names.get(module, ()), name}))
    return replace(stubs, names=names)


def _write(engine: str, version: str, python: str, wheel: Path, pins: list[str],
           stubs: StubSpec, start: Lock, added: list[str], folder: Path) -> Lock:
    """The candidate lock, written into `folder` (validated as any lock is)."""
    path = folder / lock_name(engine, version, python)
    data = lock_data(Lock(
        engine, version, python,
        Wheel(wheel.name, install.sha256_of(wheel), wheel.stat().st_size), tuple(pins),
        stubs, start.notes, path,
        {"base": start.version if start.engine == engine else
         f"{start.engine}=={start.version}", "python": python, "pip": _pip_version(),
         "date": time.strftime("%Y-%m-%d"), "added": list(added),
         "how": "harness.conform.controller.resolve: the base lock's closure under the "
                "release's own specifiers, pinned by pip's resolver, proven by the worker's "
                "load and self-test"}))
    try:
        parse_lock(data, path)
    except LockError as exc:
        raise ResolveError(f"the resolved lock does not validate: {exc}") from None
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return load_lock(path)


def _prove(lock: Lock, python: Path, home: Path) -> str | None:
    """None when the worker loads the engine under the lock's stubs and its self-test
    passes; else what went wrong (the worker's error)."""
    try:
        target = WorkerTarget(python, lock.engine, lock.stubs, home / "resolve-worker.log")
    except WorkerError as exc:
        return str(exc)
    try:
        if target.info["version"] != lock.version:
            return f"the worker imported {target.info['version']}, not {lock.version}"
        got = target.self_test()
        return "; ".join(got["problems"]) or None
    except WorkerError as exc:
        return str(exc)
    finally:
        target.close()
