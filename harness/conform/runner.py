"""`kvharness conform SPEC`: install, self-test, every check, the fuzz, the report.

SPEC is `vllm==0.33.0` or `sglang==0.5.23` (any release: installed on first use into
its cached venv from its committed lock, `harness.conform.install`, or from a lock
resolved at first use, `harness.conform.resolve`), `vllm@PATH` (a source tree's
package, imported from PATH into a venv of the nearest lock's pins, `harness.conform.tree`),
a bare `vllm` or `sglang` (the one installed in this interpreter, dev versions too, with
the nearest lock's stubs), or `kvcache` (this checkout's manager, in this process). A
release without a contract of its own takes the nearest known one's (the adapters'
CONTRACT_RELEASES), with the fields its code settles detected; the report says which. An engine runs in its worker (`harness.conform.remote`); the
checks, the oracles, the shrinking and the report run here, the same code for every
engine. Exit 0: every check passed; 1: a check found a violation; 2: the run could not
be trusted or done (an unsupported version, a failed install, a self-test that refused,
a worker that died); the report says why.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from harness.conform import checks as families
from harness.conform import install
from harness.conform.bench import run_bench
from harness.conform.checks import Check, Run
from harness.conform.fuzz import fuzz, shrink
from harness.conform.install import InstallError, ensure
from harness.conform.judge import Violation
from harness.conform.kvcache_adapter import (
    PACKAGE_MODULES,
    KvcacheCache,
    kvcache_version,
    package_dir,
)
from harness.conform.locks import (
    ADAPTERS,
    LOCK_DIR,
    NOT_RUNNABLE_HERE,
    Lock,
    LockError,
    UnsupportedVersion,
    distribution,
    find_lock,
    nearest_lock,
)
from harness.conform.ops import Op, ops_from_json, ops_to_json
from harness.conform.remote import WorkerError, WorkerTarget
from harness.conform.report import (
    EXIT_CANNOT_RUN,
    EXIT_PASSED,
    EXIT_VIOLATION,
    CheckResult,
    Report,
    write_report,
)
from harness.conform.resolve import ResolveError, resolve, resolved_dir
from harness.conform.selftest import self_test
from harness.conform.targets import LocalTarget, Target, replay
from harness.conform.tree import package_root, tree_version
from harness.conform.versions import VERSION_PATTERN, parse_version
from harness.data_files import load_json

_SPEC = re.compile(rf"([a-z][a-z0-9_-]*)(?:==({VERSION_PATTERN})|@(.+))?")
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
        """`name`, `name==version` or `name@path`; ValueError naming the text otherwise."""
        m = _SPEC.fullmatch(text.strip())
        if m is None or (m[1] == "kvcache" and (m[2] or m[3])):
            raise ValueError(f"engine spec {text!r}: expected NAME, NAME==VERSION or "
                             "NAME@PATH (vllm==0.33.0, sglang==0.5.6.post2, vllm@~/src/vllm, "
                             "sglang, kvcache)")
        return cls(m[1], m[2], Path(m[3]).expanduser() if m[3] else None)


class Engine(NamedTuple):
    """Where an engine's worker runs: its interpreter, the lock whose stubs it loads
    under, the source tree's package root (or None) and the version to pass for it."""

    python: Path
    lock: Lock
    source: Path | None
    version: str


def _kvcache_target(report: Report) -> LocalTarget:
    report.engine, report.version = "kvcache", kvcache_version()
    problems = self_test(KvcacheCache(16, 4), package_dir(), PACKAGE_MODULES)
    report.self_test = problems._asdict()
    if problems.problems:
        raise CannotRun(f"self-test refused: {'; '.join(problems.problems)}")
    return LocalTarget(f"kvcache {report.version}", KvcacheCache)


def _check_engine(engine: str) -> None:
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


def _release_lock(engine: str, version: str, base: Path, say: Say) -> Lock:
    """The lock of a release: committed, resolved earlier into the cache, or resolved now."""
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
            f"{lock.engine} {r.get('base')}'s lock (the closure under {lock.spec}'s own "
            f"specifiers, pinned by pip {r.get('pip')}'s resolver for Python "
            f"{r.get('python')}, proven by the worker's load and self-test"
            + (f"; added: {', '.join(r['added'])}" if r.get("added") else "") + ")",
            f"  {lock.path}; `kvharness conform lock {lock.spec}` writes it into the "
            "repository's locks for committing"]


def _engine(spec: EngineSpec, report: Report, say: Say) -> Engine:
    """Where `spec`'s worker runs, installing or resolving what it needs (mutates the
    engine cache); fills the report's `source` and `install`."""
    _check_engine(spec.engine)
    package = distribution(spec.engine)
    base = install.cache_dir()
    if spec.path is not None:
        root = package_root(package, spec.path)
        version, where = tree_version(package, root)
        lock = _nearest(spec.engine, version)
        start = time.perf_counter()
        env = ensure(lock, say, engine_wheel=False)
        report.install = {"venv": str(env.root), "reused": env.reused,
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
        report.install = {"venv": None, "interpreter": sys.executable}
        report.source = {"kind": "installed", "interpreter": sys.executable,
                         "package_root": str(imported_from), "stubs_from": str(lock.path)}
        say(f"{spec.engine} {version} installed in {sys.executable} ({imported_from}); "
            f"stubs of {lock.spec}")
        return Engine(Path(sys.executable), lock, imported_from, version)
    lock = _release_lock(spec.engine, spec.version, base, say)
    for line in _lock_lines(lock):
        say(line)
    start = time.perf_counter()
    env = ensure(lock, say)
    report.install = {"venv": str(env.root), "reused": env.reused,
                      "seconds": round(time.perf_counter() - start, 1)}
    report.source = {"kind": "release", "lock": str(lock.path), "committed": lock.committed,
                     "resolved": lock.resolved}
    return Engine(env.python, lock, None, spec.version)


def _worker_target(spec: EngineSpec, report: Report, folder: Path, say: Say) -> WorkerTarget:
    start = time.perf_counter()
    engine = _engine(spec, report, say)
    report.engine, report.version = spec.engine, engine.version
    report.seconds["install"] = time.perf_counter() - start
    say(f"importing {spec.engine} {engine.version} in {engine.python}")
    start = time.perf_counter()
    target = WorkerTarget(engine.python, spec.engine, engine.lock.stubs, folder / "worker.log",
                          engine.source, engine.version)
    report.seconds["import"] = time.perf_counter() - start
    report.worker = {k: v for k, v in target.info.items()
                     if k not in ("ok", "contract_basis")}
    report.contract_basis = dict(target.info.get("contract_basis", {}))
    if target.info["version"] != engine.version:
        target.close()
        raise CannotRun(f"the worker imported {spec.engine} {target.info['version']}, "
                        f"not {engine.version}")
    basis = report.contract_basis
    say(f"imported in {report.seconds['import']:.1f} s; contract of "
        + (f"{spec.engine} {basis.get('known')} (the nearest known release), detected: "
           + (", ".join(basis.get("detected", {})) or "nothing")
           if basis.get("known") not in (None, engine.version) else "this release"))
    start = time.perf_counter()
    got = target.self_test()
    report.seconds["self_test"] = time.perf_counter() - start
    report.self_test = {k: v for k, v in got.items() if k != "ok"}
    if got["problems"]:
        target.close()
        raise CannotRun(f"self-test refused: {'; '.join(got['problems'])}")
    return target


def run_check(target: Target, check: Check) -> CheckResult:
    """One family on a fresh cache, judged; a failing oracle's op list shrunk."""
    start = time.perf_counter()
    run = Run(target, check.num_blocks)
    check.body(run)
    return _result(target, check.name, check.family, check.about, check.num_blocks,
                   run.ops, run.violations, run.failures, run.observed,
                   run.reports[-1].stats._asdict() if run.reports else {},
                   time.perf_counter() - start)


def _result(target: Target, name: str, family: str, about: str, num_blocks: int,
            ops: list[Op], violations: list[Violation], failures: list[str],
            observed: dict[str, Any], stats: dict[str, Any], seconds: float) -> CheckResult:
    also = [f"{v.oracle}: {v.message.splitlines()[0]}" for v in violations[1:]] + failures
    base: dict[str, Any] = {"name": name, "family": family, "about": about,
                            "num_ops": len(ops), "observed": observed, "stats": stats,
                            "num_blocks": num_blocks}
    if violations:
        first = violations[0]
        shown = shrink(target, ops[:first.step + 1], num_blocks, first.oracle)
        # the message the shrunk op list gives (its op numbers and sizes), else the first
        again = [v for v in replay(target, shown, num_blocks, families.B)
                 if v.oracle == first.oracle]
        message = again[0].message if again else first.message
        return CheckResult(status="fail", oracle=first.oracle, message=message,
                           ops=tuple(ops_to_json(shown)),
                           ops_text=tuple(op.describe() for op in shown),
                           also=tuple(also),
                           seconds=seconds, **base)
    if failures:
        return CheckResult(status="fail", oracle="scenario", message=failures[0],
                           ops=tuple(ops_to_json(ops)),
                           ops_text=tuple(op.describe() for op in ops),
                           also=tuple(failures[1:]), seconds=seconds, **base)
    return CheckResult(status="pass", seconds=seconds, **base)


def _fuzz_check(target: Target, seed: int) -> CheckResult:
    start = time.perf_counter()
    out = fuzz(target, seed)
    found = [out.violation] if out.violation is not None else []
    return _result(target, f"fuzz_seed_{seed}", "differential fuzz",
                   f"{len(out.ops)} random ops, a pool of {out.num_blocks} blocks",
                   out.num_blocks, list(out.ops), found, [], {}, {},
                   time.perf_counter() - start)


def _progress(i: int, n: int, result: CheckResult, say: Say) -> None:
    what = "" if result.status == "pass" else \
        f" {result.oracle}: {result.message.splitlines()[0][:110]}"
    say(f"[{i:>2}/{n}] {result.name:<26} {result.status:<4} {result.seconds:6.2f} s{what}")


def conform(spec_text: str, report_dir: Path | None = None, seeds: int = 8,
            bench: bool = False, bench_quick: bool = False, only: list[str] | None = None,
            say: Say = print) -> Report:
    """Run the whole conformance of `spec_text`; writes the report and returns it
    (`exit_code` 0, 1 or 2). `only` narrows the checks by name."""
    start = time.perf_counter()
    report = Report(spec_text)
    folder = report_dir or Path(tempfile.mkdtemp(prefix="kvharness-conform-"))
    target: Target | None = None
    try:
        spec = EngineSpec.parse(spec_text)
        if spec.engine == "kvcache":
            target = _kvcache_target(report)
        else:
            target = _worker_target(spec, report, folder, say)
        report.contract = target.open(4, families.B).as_dict()
        chosen = [families.check_named(n) for n in only] if only else list(families.CHECKS)
        total = len(chosen) + seeds
        checked = time.perf_counter()
        for i, check in enumerate(chosen, 1):
            report.checks.append(run_check(target, check))
            _progress(i, total, report.checks[-1], say)
        for seed in range(seeds):
            report.checks.append(_fuzz_check(target, seed))
            _progress(len(chosen) + seed + 1, total, report.checks[-1], say)
        report.seconds["checks"] = time.perf_counter() - checked
        say(f"checks took {report.seconds['checks']:.1f} s")
        if bench or bench_quick:
            timed = time.perf_counter()
            rows = target.bench(bench_quick) if isinstance(target, WorkerTarget) else \
                [r._asdict() for r in run_bench(None, bench_quick)]
            report.bench = rows
            report.seconds["bench"] = time.perf_counter() - timed
        report.exit_code = EXIT_VIOLATION if report.failed else EXIT_PASSED
    except (CannotRun, UnsupportedVersion, LockError, InstallError, WorkerError,
            ResolveError, ValueError) as exc:
        report.exit_code = EXIT_CANNOT_RUN
        report.reason = str(exc)
    finally:
        if isinstance(target, WorkerTarget):
            target.close()
    report.seconds["total"] = time.perf_counter() - start
    paths = write_report(report, folder)
    say(f"{spec_text}: exit {report.exit_code}"
        + (f" ({report.reason.splitlines()[0]})" if report.reason else "")
        + f"; report in {paths[1]}")
    return report


def replay_file(spec_text: str, path: Path, say: Say = print) -> int:
    """Re-run one op list ({"num_blocks": N, "ops": [...]}: a check of report.json) on a
    fresh cache; prints the violations. Exit 0 none, 1 some, 2 could not run."""
    try:
        data = load_json(path, "op list")
    except ValueError as exc:  # unreadable, not JSON, too deep or too large: exit 2 too
        say(str(exc))
        return EXIT_CANNOT_RUN
    if not isinstance(data, dict) or not isinstance(data.get("num_blocks"), int):
        say(f"{path}: expected an object with num_blocks and ops (a check of report.json)")
        return EXIT_CANNOT_RUN
    try:
        op_list = ops_from_json(data.get("ops"), f"{path}: ops")
    except ValueError as exc:
        say(str(exc))
        return EXIT_CANNOT_RUN
    report = Report(spec_text)
    target: Target | None = None
    folder = Path(tempfile.mkdtemp(prefix="kvharness-replay-"))
    try:
        spec = EngineSpec.parse(spec_text)
        target = _kvcache_target(report) if spec.engine == "kvcache" else \
            _worker_target(spec, report, folder, say)
        found = replay(target, op_list, data["num_blocks"], families.B)
    except (CannotRun, UnsupportedVersion, LockError, InstallError, WorkerError,
            ResolveError, ValueError) as exc:
        say(f"cannot replay on {spec_text}: {exc}")
        return EXIT_CANNOT_RUN
    finally:
        if isinstance(target, WorkerTarget):
            target.close()
    for op in op_list:
        say(f"  {op.describe()}")
    for v in found:
        say(f"op {v.step} ({v.oracle}): {v.message}")
    say(f"{len(found)} violations" if found else "no violation")
    return EXIT_VIOLATION if found else EXIT_PASSED


def write_lock(spec_text: str, lock_dir: Path = LOCK_DIR, say: Say = print) -> int:
    """`kvharness conform lock NAME==VERSION`: the release's lock (resolved now, or the one
    resolved at first use) written into `lock_dir` for committing. Exit 0 written (or
    committed already), 2 when it cannot be made (the reason said)."""
    try:
        spec = EngineSpec.parse(spec_text)
        _check_engine(spec.engine)
        if spec.version is None:
            raise CannotRun(f"{spec_text}: name the release to lock ({spec.engine}==VERSION)")
        lock = _release_lock(spec.engine, spec.version, install.cache_dir(), say)
    except (CannotRun, UnsupportedVersion, LockError, InstallError, WorkerError,
            ResolveError, ValueError) as exc:
        say(f"cannot lock {spec_text}: {exc}")
        return EXIT_CANNOT_RUN
    target = lock_dir / lock.path.name
    if lock.path.resolve() == target.resolve():
        say(f"{lock.spec} is locked already: {target}")
        return EXIT_PASSED
    target.write_bytes(lock.path.read_bytes())  # byte for byte: the venv's stamp holds
    say(f"wrote {target} (resolved {lock.resolved.get('date') if lock.resolved else ''} "
        f"from {lock.engine} {lock.resolved.get('base') if lock.resolved else ''}); commit it")
    return EXIT_PASSED
