"""A SPEC (`vllm==0.33.0`, `sglang`, `kvcache`) parsed, and the target that runs it.

`open_target` is the one way from a SPEC to a `Target`: kvcache's manager in this
process (`LocalTarget`), or an engine in its worker (`WorkerTarget`), installed into its
cached venv first for a locked version, or the one installed in this interpreter for a
bare name. What cannot run is `CannotRun` (or a lock's, an install's or a worker's own
error), raised before any target is left open.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.conform.adapters import ADAPTERS, kvcache
from harness.conform.controller.install import ensure
from harness.conform.controller.locks import (
    NOT_RUNNABLE_HERE,
    Lock,
    distribution,
    find_lock,
)
from harness.conform.controller.remote import WorkerTarget
from harness.conform.controller.report import Report
from harness.conform.controller.targets import LocalTarget, Target

_SPEC = re.compile(r"([a-z][a-z0-9_-]*)(==([0-9][0-9A-Za-z.+-]*))?")
MAX_SPEC_CHARS = 100  # `sglang_unified==0.5.23` is 22
DEFAULT_REPORTS = Path("results") / "conform"  # a run's default folder: ENGINE[-VERSION]
Say = Callable[[str], None]


class CannotRun(RuntimeError):
    """The run cannot be done or trusted (exit 2); the message says why."""


@dataclass(frozen=True)
class EngineSpec:
    """An engine and, unless it is the one installed here, its version."""

    engine: str
    version: str | None

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        """`name` or `name==version`, surrounding spaces ignored; ValueError naming the
        text otherwise (a path, an operator, more than MAX_SPEC_CHARS characters)."""
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(f"engine spec {text[:40]!r}... of {len(text)} characters; at "
                             f"most {MAX_SPEC_CHARS}")
        m = _SPEC.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"engine spec {text!r}: expected NAME or NAME==VERSION "
                             "(vllm==0.33.0, sglang, kvcache)")
        return cls(m[1], m[3])

    def __str__(self) -> str:
        return self.engine if self.version is None else f"{self.engine}=={self.version}"

    @property
    def folder(self) -> Path:
        """The default report folder: DEFAULT_REPORTS/ENGINE or ENGINE-VERSION."""
        name = self.engine if self.version is None else f"{self.engine}-{self.version}"
        return DEFAULT_REPORTS / name


def open_target(spec: EngineSpec, report: Report, folder: Path, say: Say) -> Target:
    """The target that runs `spec`, started (a worker's log goes to `folder/worker.log`),
    its engine, version, install and worker recorded in `report` (mutated). Raises
    CannotRun for a kvcache version that is not this checkout's, an engine that cannot
    run here or is not installed, or a worker that imported another version; the lock's,
    the install's and the worker's own errors (UnsupportedVersion, LockError,
    InstallError, WorkerError) pass through. Nothing is left running when it raises."""
    if spec.engine == "kvcache":
        engine = kvcache.load()
        report.engine, report.version = engine.name, engine.version
        if spec.version is not None and spec.version != engine.version:
            raise CannotRun(f"kvcache {spec.version} is not the kvcache that would run: "
                            f"this checkout's is {engine.version} (kvcache or "
                            f"kvcache=={engine.version})")
        return LocalTarget(engine)
    return _worker_target(spec, report, folder, say)


def _engine_lock(spec: EngineSpec) -> tuple[Lock, Path | None]:
    """The lock, and the interpreter when the engine is the one installed here."""
    if spec.engine in NOT_RUNNABLE_HERE:
        raise CannotRun(f"{spec.engine} cannot run on this machine: "
                        f"{NOT_RUNNABLE_HERE[spec.engine]}")
    if spec.engine not in ADAPTERS:
        raise CannotRun(f"no adapter for {spec.engine!r}; engines: "
                        f"{', '.join([*sorted(ADAPTERS), 'kvcache'])}")
    if spec.version is not None:
        return find_lock(spec.engine, spec.version), None
    try:
        version = importlib.metadata.version(distribution(spec.engine))
    except importlib.metadata.PackageNotFoundError:
        raise CannotRun(f"{spec.engine} is not installed in this environment "
                        f"({sys.executable}); name a version ({spec.engine}==VERSION) to "
                        "install it in its own venv") from None
    return find_lock(spec.engine, version), Path(sys.executable)


def _worker_target(spec: EngineSpec, report: Report, folder: Path, say: Say) -> WorkerTarget:
    lock, python = _engine_lock(spec)
    report.engine, report.version = lock.engine, lock.version
    if python is None:
        start = time.perf_counter()
        env = ensure(lock, say)
        python = env.python
        report.install = {"lock": str(lock.path), "venv": str(env.root),
                          "reused": env.reused,
                          "seconds": round(time.perf_counter() - start, 1)}
    else:
        report.install = {"lock": str(lock.path), "venv": None, "interpreter": str(python)}
    say(f"starting {lock.spec} in {python}")
    target = WorkerTarget(python, lock.engine, lock.stubs, folder / "worker.log")
    try:  # the caller closes only a target it got
        report.worker = {k: v for k, v in target.info.items() if k != "ok"}
        if target.info["version"] != lock.version:
            raise CannotRun(f"the worker imported {lock.engine} {target.info['version']}, "
                            f"not {lock.version}")
    except BaseException:
        target.close()
        raise
    return target
