"""`kvharness conform SPEC`: install, self-test, every check, the fuzz, the report.

SPEC is `ENGINE==VERSION` (a locked version, harness/conform/locks/: installed on first
use into its cached venv, `harness.conform.controller.install`), a bare `vllm` or `sglang`
(the one installed in this interpreter, with its version's stubs), or `kvcache` (this
checkout's manager, in this process): `engine_spec.open_target` picks its target. An
engine runs in its worker (`harness.conform.controller.remote`); the checks, the oracles,
the shrinking and the report run here, the same code for every engine. Exit 0: every
check passed; 1: a check found a violation; 2: the run could not be trusted or done (an
unsupported version, a failed install, a self-test that refused, a worker that died or
answered nonsense, an engine that touched a stub); the report says why.

The SPEC is data: the report goes to `--report DIR`, else to `results/conform/` under a
name made of the parsed engine and version (a SPEC that does not parse gets no report
folder: nothing is written). The folder is checked before anything runs.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from harness.conform.controller import families
from harness.conform.controller.checks import CHECKS, check_named
from harness.conform.controller.engine_spec import CannotRun, EngineSpec, open_target
from harness.conform.controller.families import Check, Run
from harness.conform.controller.fuzz import fuzz, shrink
from harness.conform.controller.install import InstallError
from harness.conform.controller.judge import Violation
from harness.conform.controller.locks import LockError, UnsupportedVersion
from harness.conform.controller.remote import StubTouched, WorkerError
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
from harness.conform.controller.targets import Target, replay
from harness.conform.ops import Op, ops_from_json, ops_to_json
from harness.conform.protocol import CacheOptions
from harness.data_files import load_json

Say = Callable[[str], None]


def _open(spec: EngineSpec, report: Report, folder: Path, say: Say) -> Target:
    """`open_target`, self-tested (into `report`); CannotRun, the target closed, when the
    self-test refused."""
    target = open_target(spec, report, folder, say)
    try:  # the caller closes only a target it got
        report.self_test = target.self_test()
        if report.self_test["problems"]:
            raise CannotRun(f"self-test refused: {'; '.join(report.self_test['problems'])}")
    except BaseException:
        target.close()
        raise
    return target


class Finished(NamedTuple):
    """A check that ran, before it is judged into a `CheckResult`: what it was, its cache
    of `num_blocks` blocks, its op list, the oracles' violations and the family's own
    failures, what it observed, the engine's counters at the end and its seconds."""

    name: str
    family: str
    about: str
    num_blocks: int
    ops: list[Op]
    violations: list[Violation]
    failures: list[str]
    observed: dict[str, Any]
    stats: dict[str, Any]
    seconds: float
    options: CacheOptions = CacheOptions()

    @classmethod
    def of_check(cls, check: Check, run: Run, seconds: float) -> Finished:
        """A family's run."""
        return cls(check.name, check.family, check.about, check.num_blocks, run.ops,
                   run.violations, run.failures, run.observed,
                   run.reports[-1].stats._asdict() if run.reports else {}, seconds,
                   check.options)


def run_check(target: Target, check: Check) -> CheckResult:
    """One family on a fresh cache, judged; a failing oracle's op list shrunk. A family
    the engine's contract cannot judge (`Check.skip_reason`) is skipped, saying why."""
    start = time.perf_counter()
    why = check.skip_reason(target.open(check.num_blocks, families.B))
    if why is not None:
        return CheckResult(name=check.name, family=check.family, about=check.about,
                           status="skip", message=why, num_blocks=check.num_blocks,
                           seconds=time.perf_counter() - start)
    run = Run(target, check.num_blocks, check.options)
    check.body(run)
    return _result(target, Finished.of_check(check, run, time.perf_counter() - start))


def _result(target: Target, done: Finished) -> CheckResult:
    """The verdict on `done`: its first violation with the op list shrunk to one that
    still shows it (replayed on `target`), else its first failure, else a pass."""
    also = [f"{v.oracle}: {v.message.splitlines()[0]}" for v in done.violations[1:]] + \
        done.failures
    base: dict[str, Any] = {"name": done.name, "family": done.family, "about": done.about,
                            "num_ops": len(done.ops), "observed": done.observed,
                            "stats": done.stats, "num_blocks": done.num_blocks,
                            "options": done.options.as_dict(), "seconds": done.seconds}
    if done.violations:
        first = done.violations[0]
        shown = shrink(target, done.ops[:first.step + 1], done.num_blocks, first.oracle,
                       options=done.options)
        # the message the shrunk op list gives (its op numbers and sizes), else the first
        again = [v for v in replay(target, shown, done.num_blocks, families.B, done.options)
                 if v.oracle == first.oracle]
        message = again[0].message if again else first.message
        return CheckResult(status="fail", oracle=first.oracle, message=message,
                           ops=tuple(ops_to_json(shown)),
                           ops_text=tuple(op.describe() for op in shown),
                           also=tuple(also), **base)
    if done.failures:
        return CheckResult(status="fail", oracle="scenario", message=done.failures[0],
                           ops=tuple(ops_to_json(done.ops)),
                           ops_text=tuple(op.describe() for op in done.ops),
                           also=tuple(done.failures[1:]), **base)
    return CheckResult(status="pass", **base)


def _fuzz_check(target: Target, seed: int) -> CheckResult:
    start = time.perf_counter()
    out = fuzz(target, seed)
    found = [out.violation] if out.violation is not None else []
    return _result(target, Finished(
        f"fuzz_seed_{seed}", "differential fuzz",
        f"{len(out.ops)} random ops, a pool of {out.num_blocks} blocks", out.num_blocks,
        list(out.ops), found, [], {}, {}, time.perf_counter() - start, out.options))


def _progress(i: int, n: int, result: CheckResult, say: Say) -> None:
    what = "" if result.status == "pass" else \
        f" {result.oracle or result.status}: {result.message.splitlines()[0][:110]}"
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
    (default: the SPEC's folder under `engine_spec.DEFAULT_REPORTS`, none for a SPEC that does not
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
        target = _open(spec, report, folder, say)
        report.contract = target.open(4, families.B).as_dict()
        report.seconds["setup"] = time.perf_counter() - start
        chosen = [check_named(n) for n in only] if only else list(CHECKS)
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
            report.bench = target.bench(bench_quick)
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
        if target is not None:
            target.close()


def replay_file(spec_text: str, path: Path, say: Say = print) -> int:
    """Re-run one op list ({"num_blocks": N, "ops": [...], "options": {...}}: a check of
    report.json) on a fresh cache opened with those options; prints the violations.
    Exit 0 none, 1 some, 2 could not run."""
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
        options = CacheOptions.from_dict(data.get("options"), f"{path}: options")
    except ValueError as exc:
        say(str(exc))
        return EXIT_CANNOT_RUN
    report = Report(spec_text)
    target: Target | None = None
    folder = Path(tempfile.mkdtemp(prefix="kvharness-replay-"))
    try:
        spec = EngineSpec.parse(spec_text)
        target = _open(spec, report, folder, say)
        found = replay(target, op_list, data["num_blocks"], families.B, options)
    except (CannotRun, UnsupportedVersion, LockError, InstallError, WorkerError,
            ValueError) as exc:
        say(f"cannot replay on {spec_text}: {exc}")
        return EXIT_CANNOT_RUN
    finally:
        if target is not None:
            target.close()
    for op in op_list:
        say(f"  {op.describe()}")
    for v in found:
        say(f"op {v.step} ({v.oracle}): {v.message}")
    say(f"{len(found)} violations" if found else "no violation")
    return EXIT_VIOLATION if found else EXIT_PASSED
