"""A SPEC (`vllm==0.33.0`, `vllm@PATH`, `sglang`, `kvcache`) parsed, and the target that
runs it.

`open_target` is the one way from a SPEC to a `Target`: kvcache's manager in this
process (`LocalTarget`), or an engine in its worker (`WorkerTarget`): a release
installed into its cached venv first from its committed lock, or from a lock resolved at
first use (`harness.conform.controller.resolve`); a source tree's package imported from
where it is into a venv of the nearest lock's pins (`harness.conform.controller.tree`);
or, for a bare name, the one installed in this interpreter (dev versions too), with the
nearest lock's stubs. A release without a contract of its own takes the nearest known
one's (the adapters' CONTRACT_RELEASES), with the fields its code settles detected; the
report says which. What cannot run is `CannotRun` (or a lock's, a resolution's, an
install's or a worker's own error), raised before any target is left open.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from harness.conform.adapters import ADAPTERS, kvcache
from harness.conform.controller import install
from harness.conform.controller.locks import (
    NOT_RUNNABLE_HERE,
    Lock,
    UnsupportedVersion,
    base_of,
    distribution,
    find_lock,
    nearest_lock,
)
from harness.conform.controller.remote import WorkerTarget
from harness.conform.controller.report import Report
from harness.conform.controller.resolve import resolve, resolved_dir
from harness.conform.controller.targets import LocalTarget, Target
from harness.conform.controller.tree import package_root, tree_version
from harness.conform.stubs import OVERRIDES
from harness.conform.versions import VERSION_PATTERN, parse_version

_SPEC = re.compile(rf"([a-z][a-z0-9_-]*)(?:==({VERSION_PATTERN})|@(.+))?")
MAX_SPEC_CHARS = 100  # `sglang_unified==0.5.23` is 22; a path after `@` is not counted
MAX_PATH_CHARS = 4096  # a source tree's path: Linux's PATH_MAX
DEFAULT_REPORTS = Path("results") / "conform"  # a run's default folder: ENGINE[-VERSION]
Say = Callable[[str], None]


class CannotRun(RuntimeError):
    """The run cannot be done or trusted (exit 2); the message says why."""


@dataclass(frozen=True)
class EngineSpec:
    """An engine and where it comes from: a release (`version`), a source tree (`path`),
    or neither (the one installed here)."""

    engine: str
    version: str | None = None
    path: Path | None = None

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        """`name`, `name==version` or `name@path`, surrounding spaces ignored; ValueError
        naming the text otherwise (an operator, a path alone, kvcache with a path, more
        than MAX_SPEC_CHARS characters before the `@` or MAX_PATH_CHARS after it)."""
        head, _, tail = text.partition("@")
        if len(head) > MAX_SPEC_CHARS:
            raise ValueError(f"engine spec {text[:40]!r}... of {len(text)} characters; at "
                             f"most {MAX_SPEC_CHARS}")
        if len(tail) > MAX_PATH_CHARS:
            raise ValueError(f"engine spec {text[:40]!r}...: a path of {len(tail)} "
                             f"characters; at most {MAX_PATH_CHARS}")
        m = _SPEC.fullmatch(text.strip())
        if m is None or (m[1] == "kvcache" and m[3]):
            raise ValueError(f"engine spec {text!r}: expected NAME, NAME==VERSION or "
                             "NAME@PATH (vllm==0.33.0, sglang==0.5.6.post2, vllm@~/src/vllm, "
                             "sglang, kvcache)")
        return cls(m[1], m[2], Path(m[3]).expanduser() if m[3] else None)

    def __str__(self) -> str:
        if self.path is not None:
            return f"{self.engine}@{self.path}"
        return self.engine if self.version is None else f"{self.engine}=={self.version}"

    @property
    def folder(self) -> Path:
        """The default report folder: DEFAULT_REPORTS/ENGINE, ENGINE-VERSION or
        ENGINE-tree (a source tree: its path never names a folder)."""
        name = f"{self.engine}-tree" if self.path is not None else \
            self.engine if self.version is None else f"{self.engine}-{self.version}"
        return DEFAULT_REPORTS / name


class Engine(NamedTuple):
    """Where an engine's worker runs: its interpreter, the lock whose stubs it loads
    under, the source tree's package root (or None) and the version to pass for it."""

    python: Path
    lock: Lock
    source: Path | None
    version: str


def open_target(spec: EngineSpec, report: Report, folder: Path, say: Say) -> Target:
    """The target that runs `spec`, started (a worker's log goes to `folder/worker.log`),
    its engine, version, source, install, worker, contract basis and seconds (install,
    import) recorded in `report` (mutated). Raises CannotRun for a kvcache version that
    is not this checkout's, an engine that cannot run here or is not installed, a version
    that is not a registry release, or a worker that imported another version; the
    lock's, the resolution's, the tree's, the install's and the worker's own errors
    (UnsupportedVersion, LockError, ResolveError, TreeError, InstallError, WorkerError)
    pass through. Nothing is left running when it raises."""
    if spec.engine == "kvcache":
        engine = kvcache.load()
        report.engine, report.version = engine.name, engine.version
        if spec.version is not None and spec.version != engine.version:
            raise CannotRun(f"kvcache {spec.version} is not the kvcache that would run: "
                            f"this checkout's is {engine.version} (kvcache or "
                            f"kvcache=={engine.version})")
        return LocalTarget(engine)
    return _worker_target(spec, report, folder, say)


def check_engine(engine: str) -> None:
    """CannotRun for an engine that cannot run here or has no adapter."""
    if engine in NOT_RUNNABLE_HERE:
        raise CannotRun(f"{engine} cannot run on this machine: {NOT_RUNNABLE_HERE[engine]}")
    if engine not in ADAPTERS:
        raise CannotRun(f"no adapter for {engine!r}; engines: "
                        f"{', '.join([*sorted(ADAPTERS), 'kvcache'])}")


def _nearest(engine: str, version: str) -> Lock:
    lock = nearest_lock(engine, version)
    if lock is None:
        raise CannotRun(f"{engine} has no committed lock: nothing to take stubs and pins "
                        "from (docs/conformance.md, 'Adding an engine')")
    return lock


def release_lock(engine: str, version: str, base: Path, say: Say) -> Lock:
    """The lock of a release: committed, resolved earlier into the engine cache `base`,
    or resolved now (mutates the cache). CannotRun for a version that is not a registry
    release; ResolveError (`harness.conform.controller.resolve`) when none can be made."""
    if not parse_version(version).is_release:
        raise CannotRun(f"{engine} {version} is not a registry release: run a checkout as "
                        f"{engine}@PATH, or the one installed here as a bare {engine}")
    try:
        return find_lock(engine, version, resolved_dir=resolved_dir(base))
    except UnsupportedVersion:
        pass
    with install.file_lock(base / f"{engine}-{version}.resolve.lock"):
        try:  # another run may have resolved it while this one waited
            return find_lock(engine, version, resolved_dir=resolved_dir(base))
        except UnsupportedVersion:
            return resolve(engine, version, base, say)


def _lock_lines(lock: Lock) -> list[str]:
    """What the run's first lines say of a lock that is not committed."""
    if lock.committed or lock.resolved is None:
        return []
    r = lock.resolved
    return [f"{lock.spec} is unlocked: its lock was resolved on {r.get('date')} from "
            f"{base_of(lock.engine, r.get('base'))}'s lock (the closure under {lock.spec}'s own "
            f"specifiers, pinned by pip {r.get('pip')}'s resolver for Python "
            f"{r.get('python')}, proven by the worker's load and self-test"
            + (f"; added: {', '.join(r['added'])}" if r.get("added") else "") + ")",
            f"  {lock.path}; `kvharness conform lock {lock.spec}` writes it into the "
            "repository's locks for committing"]


def _engine(spec: EngineSpec, report: Report, say: Say) -> Engine:
    """Where `spec`'s worker runs, installing or resolving what it needs (mutates the
    engine cache); fills the report's `source` and `install`."""
    check_engine(spec.engine)
    package = distribution(spec.engine)
    base = install.cache_dir()
    if spec.path is not None:
        root = package_root(package, spec.path)
        version, where = tree_version(package, root)
        lock = _nearest(spec.engine, version)
        start = time.perf_counter()
        env = install.ensure(lock, say, engine_wheel=False)
        report.install = {"lock": str(lock.path), "venv": str(env.root),
                          "reused": env.reused,
                          "seconds": round(time.perf_counter() - start, 1)}
        report.source = {"kind": "tree", "path": str(root), "version_from": where,
                         "pins_and_stubs_from": str(lock.path)}
        say(f"{spec.engine} {version} from the source tree {root} (version from {where}); "
            f"pins and stubs of {lock.spec}")
        return Engine(env.python, lock, root, version)
    if spec.version is None:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise CannotRun(f"{spec.engine} is not installed in this environment "
                            f"({sys.executable}); name a release ({spec.engine}==VERSION) "
                            f"or a source tree ({spec.engine}@PATH)") from None
        lock = _nearest(spec.engine, version)
        # the folder this interpreter imports the package from (a PYTHONPATH or an
        # editable install's path), so the worker imports the same code
        found = importlib.util.find_spec(package)
        locations = list(found.submodule_search_locations or ()) if found else []
        imported_from = Path(locations[0]).parent if locations else None
        report.install = {"lock": str(lock.path), "venv": None, "interpreter": sys.executable}
        report.source = {"kind": "installed", "interpreter": sys.executable,
                         "package_root": str(imported_from), "stubs_from": str(lock.path)}
        say(f"{spec.engine} {version} installed in {sys.executable} ({imported_from}); "
            f"stubs of {lock.spec}")
        return Engine(Path(sys.executable), lock, imported_from, version)
    lock = release_lock(spec.engine, spec.version, base, say)
    for line in _lock_lines(lock):
        say(line)
    start = time.perf_counter()
    env = install.ensure(lock, say)
    report.install = {"lock": str(lock.path), "venv": str(env.root), "reused": env.reused,
                      "seconds": round(time.perf_counter() - start, 1)}
    report.source = {"kind": "release", "lock": str(lock.path), "committed": lock.committed,
                     "resolved": lock.resolved}
    return Engine(env.python, lock, None, spec.version)


def _worker_target(spec: EngineSpec, report: Report, folder: Path, say: Say) -> WorkerTarget:
    start = time.perf_counter()
    engine = _engine(spec, report, say)
    report.engine, report.version = spec.engine, engine.version
    if engine.lock.stubs.overrides:  # what the worker answers for a dependency
        report.source["overrides"] = {key: f"{OVERRIDES[key].target}: {OVERRIDES[key].what}"
                                      for key in engine.lock.stubs.overrides}
    report.seconds["install"] = time.perf_counter() - start
    say(f"importing {spec.engine} {engine.version} in {engine.python}")
    start = time.perf_counter()
    target = WorkerTarget(engine.python, spec.engine, engine.lock.stubs, folder / "worker.log",
                          engine.source, engine.version)
    report.seconds["import"] = time.perf_counter() - start
    try:  # the caller closes only a target it got
        report.worker = {k: v for k, v in target.info.items()
                         if k not in ("ok", "contract_basis")}
        report.contract_basis = dict(target.info["contract_basis"])
        if target.info["version"] != engine.version:
            raise CannotRun(f"the worker imported {spec.engine} {target.info['version']}, "
                            f"not {engine.version}")
    except BaseException:
        target.close()
        raise
    basis = report.contract_basis
    say(f"imported in {report.seconds['import']:.1f} s; contract of "
        + (f"{spec.engine} {basis.get('known')} (the nearest known release), detected: "
           + (", ".join(basis.get("detected", {})) or "nothing")
           if basis.get("known") not in (None, engine.version) else "this release"))
    return target
