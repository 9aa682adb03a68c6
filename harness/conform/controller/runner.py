"""`kvharness conform SPEC`: install, self-test, every check, the fuzz, the report.

SPEC is `vllm==0.33.0` or `sglang==0.5.23` (a locked version: installed on first use
into its cached venv, `harness.conform.controller.install`), a bare `vllm` or `sglang` (the one
installed in this interpreter, with its version's stubs), or `kvcache` (this checkout's
manager, in this process). An engine runs in its worker (`harness.conform.controller.remote`); the
checks, the oracles, the shrinking and the report run here, the same code for every
engine. Exit 0: every check passed; 1: a check found a violation; 2: the run could not
be trusted or done (an unsupported version, a failed install, a self-test that refused,
a worker that died or answered nonsense, an engine that touched a stub); the report
says why.

The SPEC is data: the report goes to `--report DIR`, else to `results/conform/` under a
name made of the parsed engine and version (a SPEC that does not parse gets no report
folder: nothing is written). The folder is checked before anything runs.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.conform.adapters import ADAPTERS
from harness.conform.adapters.kvcache import (
    PACKAGE_MODULES,
    KvcacheCache,
    kvcache_version,
    package_dir,
)
from harness.conform.controller import families
from harness.conform.controller.families import Check, Run
from harness.conform.controller.fuzz import fuzz, shrink
from harness.conform.controller.install import InstallError, ensure
from harness.conform.controller.judge import Violation
from harness.conform.controller.locks import (
    NOT_RUNNABLE_HERE,
    Lock,
    LockError,
    UnsupportedVersion,
    distribution,
    find_lock,
)
from harness.conform.controller.remote import StubTouched, WorkerError, WorkerTarget
from harness.conform.controller.report import (
    EXIT_CANNOT_RUN,
    EXIT_PASSED,
    EXIT_VIOLATION,
    CheckResult,
    Report,
    ReportFolderError,
    prepare_folder,
    write_report,
)
from harness.conform.controller.targets import LocalTarget, Target, replay
from harness.conform.ops import Op, ops_from_json, ops_to_json
from harness.conform.worker.bench import run_bench
from harness.conform.worker.selftest import self_test
from harness.data_files import load_json

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


def _kvcache_target(spec: EngineSpec, report: Report) -> LocalTarget:
    report.engine, report.version = "kvcache", kvcache_version()
    if spec.version is not None and spec.version != report.version:
        raise CannotRun(f"kvcache {spec.version} is not the kvcache that would run: this "
                        f"checkout's is {report.version} (kvcache or kvcache=={report.version})")
    problems = self_test(KvcacheCache(16, 4), package_dir(), PACKAGE_MODULES)
    report.self_test = problems._asdict()
    if problems.problems:
        raise CannotRun(f"self-test refused: {'; '.join(problems.problems)}")
    return LocalTarget(f"kvcache {report.version}", KvcacheCache)


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
        got = target.self_test()
        report.self_test = {k: v for k, v in got.items() if k != "ok"}
        if got["problems"]:
            raise CannotRun(f"self-test refused: {'; '.join(got['problems'])}")
    except BaseException:
        target.close()
        raise
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


def _stub_reason(exc: StubTouched, report: Report) -> str:
    lock = report.install.get("lock", f"the lock of {report.engine} {report.version}")
    return (f"{exc}\nThe engine touched the stub {exc.stub}: the run cannot be trusted. "
            f"Its cache path reaches {exc.module}, which {lock} lists among the modules "
            "that cannot run here; that lock's stubs are wrong for this version.")


def conform(spec_text: str, report_dir: Path | None = None, seeds: int = 8,
            bench: bool = False, bench_quick: bool = False, only: list[str] | None = None,
            say: Say = print) -> Report:
    """Run the whole conformance of `spec_text`; writes the report into `report_dir`
    (default: the SPEC's folder under DEFAULT_REPORTS, none for a SPEC that does not
    parse) and returns it (`exit_code` 0, 1 or 2). `only` narrows the checks by name.
    A folder that cannot take the report is exit 2 before anything runs."""
    start = time.perf_counter()
    report = Report(spec_text)
    try:
        spec: EngineSpec | None = EngineSpec.parse(spec_text)
    except ValueError as exc:
        spec, report.reason = None, str(exc)
    folder = report_dir if report_dir is not None or spec is None else spec.folder
    if folder is not None:
        try:
            prepare_folder(folder)
        except ReportFolderError as exc:
            report.reason = str(exc)
            say(f"{spec_text}: exit {report.exit_code} ({exc}); nothing ran")
            return report
    if spec is not None:
        assert folder is not None  # a parsed SPEC has its folder
        # before any install: the SPEC that runs, said as it will run
        stripped = "" if spec_text == str(spec) else \
            f" (the SPEC {spec_text!r} without its surrounding spaces)"
        say(f"conform {spec}{stripped}")
        _run(spec, report, folder, seeds, bench, bench_quick, only, say)
    report.seconds["total"] = time.perf_counter() - start
    where = "; no report (the SPEC names no engine to file it under)"
    if folder is not None:
        try:
            where = f"; report in {write_report(report, folder)[1]}"
        except OSError as exc:
            report.exit_code = EXIT_CANNOT_RUN
            where = f"; the report could not be written to {folder}: {exc}"
    say(f"{spec_text}: exit {report.exit_code}"
        + (f" ({report.reason.splitlines()[0]})" if report.reason else "") + where)
    return report


def _run(spec: EngineSpec, report: Report, folder: Path, seeds: int, bench: bool,
         bench_quick: bool, only: list[str] | None, say: Say) -> None:
    """The run itself, into `report` (mutated): its checks, its exit code and reason."""
    start = time.perf_counter()
    target: Target | None = None
    try:
        if spec.engine == "kvcache":
            target = _kvcache_target(spec, report)
        else:
            target = _worker_target(spec, report, folder, say)
        report.contract = target.open(4, families.B).as_dict()
        report.seconds["setup"] = time.perf_counter() - start
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
        if bench or bench_quick:
            timed = time.perf_counter()
            rows = target.bench(bench_quick) if isinstance(target, WorkerTarget) else \
                [r._asdict() for r in run_bench(None, bench_quick)]
            report.bench = rows
            report.seconds["bench"] = time.perf_counter() - timed
        report.exit_code = EXIT_VIOLATION if report.failed else EXIT_PASSED
    except StubTouched as exc:
        report.exit_code = EXIT_CANNOT_RUN
        report.reason = _stub_reason(exc, report)
    except (CannotRun, UnsupportedVersion, LockError, InstallError, WorkerError,
            ValueError) as exc:
        report.exit_code = EXIT_CANNOT_RUN
        report.reason = str(exc)
    finally:
        if isinstance(target, WorkerTarget):
            target.close()


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
        target = _kvcache_target(spec, report) if spec.engine == "kvcache" else \
            _worker_target(spec, report, folder, say)
        found = replay(target, op_list, data["num_blocks"], families.B)
    except (CannotRun, UnsupportedVersion, LockError, InstallError, WorkerError,
            ValueError) as exc:
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
