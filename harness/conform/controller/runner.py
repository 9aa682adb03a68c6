"""`kvharness conform SPEC`: install, self-test, every check, the fuzz, the report.

SPEC is `ENGINE==VERSION` (any release: installed on first use into its cached venv
from its committed lock, harness/conform/locks/, `harness.conform.controller.install`, or
from a lock resolved at first use, `harness.conform.controller.resolve`), `ENGINE@PATH`
(a source tree's package, imported from PATH into a venv of the nearest lock's pins,
`harness.conform.controller.tree`), a bare `vllm` or `sglang` (the one installed in this
interpreter, dev versions too, with the nearest lock's stubs), or `kvcache` (this
checkout's manager, in this process): `engine_spec.open_target` picks its target. A
release without a contract of its own takes the nearest known one's (the adapters'
CONTRACT_RELEASES), with the fields its code settles detected; the report says which. An
engine runs in its worker (`harness.conform.controller.remote`); the checks, the oracles,
the shrinking and the report run here, the same code for every engine. Exit 0: every
check passed; 1: a check found a violation; 2: the run could not be trusted or done (a
version no lock could be resolved for, a failed install, a self-test that refused, a
worker that died or answered nonsense, an engine that touched a stub); the report says
why. `write_lock` is `kvharness conform lock NAME==VERSION`.

The SPEC is data: the report goes to `--report DIR`, else to `results/conform/` under a
name made of the parsed engine and version (a SPEC that does not parse gets no report
folder: nothing is written). The folder is checked before anything runs.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from harness.conform.controller import families, known_findings
from harness.conform.controller import replay_file as replay_files
from harness.conform.controller.checks import CHECKS, check_named
from harness.conform.controller.engine_spec import (
    CannotRun,
    EngineSpec,
    check_engine,
    open_target,
    release_lock,
)
from harness.conform.controller.expectations import Expectation, Unmet
from harness.conform.controller.families import Check, Run
from harness.conform.controller.fuzz import fuzz, shrink
from harness.conform.controller.install import InstallError, cache_dir
from harness.conform.controller.judge import Violation
from harness.conform.controller.locks import LOCK_DIR, LockError, UnsupportedVersion, base_of
from harness.conform.controller.remote import StubTouched, WorkerError
from harness.conform.controller.report import (
    EXIT_CANNOT_RUN,
    EXIT_PASSED,
    EXIT_VIOLATION,
    CheckResult,
    Report,
    ReportFolderError,
    prepare_folder,
    this_run,
    write_report,
)
from harness.conform.controller.resolve import ResolveError
from harness.conform.controller.targets import Target, replay
from harness.conform.ops import Op, ops_to_json
from harness.conform.protocol import CacheOptions, Contract

Say = Callable[[str], None]


def _open(spec: EngineSpec, report: Report, folder: Path, say: Say) -> Target:
    """`open_target`, self-tested (into `report`, with its seconds); CannotRun, the target
    closed, when the self-test refused."""
    target = open_target(spec, report, folder, say)
    try:  # the caller closes only a target it got
        start = time.perf_counter()
        report.self_test = target.self_test()
        report.seconds["self_test"] = time.perf_counter() - start
        if report.self_test["problems"]:
            raise CannotRun(f"self-test refused: {'; '.join(report.self_test['problems'])}")
    except BaseException:
        target.close()
        raise
    return target


class Finished(NamedTuple):
    """A check that ran, before it is judged into a `CheckResult`: what it was, its cache
    of `num_blocks` blocks, its op list, the oracles' violations, the family's declared
    expectations and those that did not hold, what it observed, the engine's counters
    at the end and its seconds."""

    name: str
    family: str
    about: str
    num_blocks: int
    ops: list[Op]
    violations: list[Violation]
    expectations: list[Expectation]
    unmet: list[Unmet]
    observed: dict[str, Any]
    stats: dict[str, Any]
    seconds: float
    options: CacheOptions = CacheOptions()
    contract: Contract | None = None  # what the cache opened with `options` stated

    @classmethod
    def of_check(cls, check: Check, run: Run, seconds: float) -> Finished:
        """A family's run."""
        return cls(check.name, check.family, check.about, check.num_blocks, run.ops,
                   run.violations, run.expectations, run.unmet(), run.observed,
                   run.reports[-1].stats._asdict() if run.reports else {}, seconds,
                   run.options, run.contract)


def run_check(target: Target, check: Check) -> CheckResult:
    """One family on a fresh cache, judged; a failing oracle's op list shrunk. A family
    the engine's contract cannot judge (`Check.skip_reason`) is skipped, saying why."""
    start = time.perf_counter()
    plain = target.open(check.num_blocks, families.B)
    why = check.skip_reason(plain, lambda options: target.open(check.num_blocks, families.B,
                                                               options))
    if why is not None:
        return CheckResult(name=check.name, family=check.family, about=check.about,
                           status="skip", message=why, num_blocks=check.num_blocks,
                           seconds=time.perf_counter() - start)
    run = Run(target, check.num_blocks, check.options_for(plain))
    check.body(run)
    return _result(target, Finished.of_check(check, run, time.perf_counter() - start))


def _went_through(target: Target, op: dict[str, Any]) -> tuple[str, ...] | None:
    """The engine functions an op like `op` goes through on the cache open on `target`
    (`Target.engine_code`; `path: Qualified.name`, `?: name` where its source was not
    found), None where the adapter names none for its kind."""
    code = target.engine_code()
    names = code["calls"].get(op.get("kind", ""))
    if names is None:
        return None
    return tuple(code["functions"].get(name, f"?: {name}") for name in names)


def _result(target: Target, done: Finished) -> CheckResult:
    """The verdict on `done`: its first violation with the op list shrunk to one that
    still shows it (replayed on `target`), else its first unmet expectation that is a
    failure, else its first known limitation (the whole op list and the expectations
    with it: a replay judges them again), else a pass."""
    failures = [u for u in done.unmet if u.limitation is None]
    limitations = [u for u in done.unmet if u.limitation is not None]
    also = [f"{v.oracle}: {v.message.splitlines()[0]}" for v in done.violations[1:]] + \
        [u.message for u in failures + limitations]
    base: dict[str, Any] = {"name": done.name, "family": done.family, "about": done.about,
                            "num_ops": len(done.ops), "observed": done.observed,
                            "stats": done.stats, "num_blocks": done.num_blocks,
                            "block_size": families.B, "options": done.options.as_dict(),
                            "seconds": done.seconds}
    if (done.violations or done.unmet) and done.options != CacheOptions() \
            and done.contract is not None:
        # the contract its options opened the cache under, other than the report's (its
        # replay file records it)
        base["contract"] = done.contract.as_dict()
    if done.violations:
        first = done.violations[0]
        shown = shrink(target, done.ops[:first.step + 1], done.num_blocks, first,
                       options=done.options)
        # the message the shrunk op list gives (its op numbers and sizes), else the first
        again = [v for v in replay(target, shown.ops, shown.num_blocks, families.B,
                                   done.options)
                 if v.oracle == first.oracle]
        found = again[0] if again else first._replace(step=len(shown.ops) - 1)
        ops = ops_to_json(shown.ops)  # the replay left a cache opened as the check's open
        return CheckResult(status="fail", oracle=first.oracle, message=found.message,
                           ops=tuple(ops), ops_text=tuple(op.describe() for op in shown.ops),
                           step=found.step, also=tuple(also),
                           went_through=_went_through(target, ops[found.step]),
                           **{**base, "num_blocks": shown.num_blocks})
    if failures or limitations:
        unmet = (failures or limitations)[0]
        ops = ops_to_json(done.ops)  # the check's own cache is still open
        return CheckResult(status="fail" if failures else "limitation",
                           oracle="scenario", message=unmet.message,
                           limitation=unmet.limitation or "",
                           ops=tuple(ops), went_through=None if unmet.step is None
                           else _went_through(target, ops[unmet.step]),
                           ops_text=tuple(op.describe() for op in done.ops),
                           expectations=tuple(e.as_dict() for e in done.expectations),
                           step=unmet.step, also=tuple(also[1:]), **base)
    return CheckResult(status="pass", **base)


def fuzz_check(target: Target, seed: int) -> CheckResult:
    """Fuzz seed `seed` on `target`, judged; its failure shrunk (`_result`)."""
    start = time.perf_counter()
    out = fuzz(target, seed)
    found = [out.violation] if out.violation is not None else []
    return _result(target, Finished(
        f"fuzz_seed_{seed}", "differential fuzz",
        f"{len(out.ops)} random ops, a pool of {out.num_blocks} blocks", out.num_blocks,
        list(out.ops), found, [], [], {}, {}, time.perf_counter() - start, out.options,
        out.contract))


def _annotated(result: CheckResult, report: Report) -> CheckResult:
    """`result`, with the known finding it shows (`known_findings.match`) when it failed."""
    if result.status != "fail":
        return result
    known = known_findings.match(report.engine, report.version, result.name, result.oracle,
                                 result.message)
    return result if known is None else replace(result, known=known.as_dict())


def _progress(i: int, n: int, result: CheckResult, say: Say) -> None:
    what = "" if result.status == "pass" else \
        f" {result.oracle or result.status}: {result.message.splitlines()[0][:110]}"
    say(f"[{i:>2}/{n}] {result.name:<26} {result.status:<4} {result.seconds:6.2f} s{what}")


def _stub_reason(exc: StubTouched, report: Report) -> str:
    lock = report.install.get("lock", f"the lock of {report.engine} {report.version}")
    return (f"{exc}\nThe engine touched the stub {exc.stub}: the run cannot be trusted. "
            f"Its cache path reaches {exc.module}, which {lock} lists among the modules "
            "that cannot run here; that lock's stubs are wrong for this version.")


def check_all(target: Target, report: Report, chosen: list[Check], seeds: int,
              say: Say) -> None:
    """The `chosen` checks and `seeds` fuzz seeds on `target` (self-tested), into `report`
    (mutated: its contract, checks, seconds and exit code: 1 when a check found a
    violation, else 0, known limitations included: `Report.verdict` tells them apart)."""
    report.contract = target.open(4, families.B).as_dict()
    total = len(chosen) + seeds
    checked = time.perf_counter()
    for i, check in enumerate(chosen, 1):
        report.checks.append(_annotated(run_check(target, check), report))
        _progress(i, total, report.checks[-1], say)
    for seed in range(seeds):
        report.checks.append(_annotated(fuzz_check(target, seed), report))
        _progress(len(chosen) + seed + 1, total, report.checks[-1], say)
    report.seconds["checks"] = time.perf_counter() - checked
    say(f"checks took {report.seconds['checks']:.1f} s")
    report.exit_code = EXIT_VIOLATION if report.failed else EXIT_PASSED


def conform(spec_text: str, report_dir: Path | None = None, seeds: int = 8,
            bench: bool = False, bench_quick: bool = False, only: list[str] | None = None,
            say: Say = print) -> Report:
    """Run the whole conformance of `spec_text`; writes the report into `report_dir`
    (default: the SPEC's folder under `engine_spec.DEFAULT_REPORTS`, none for a SPEC that does not
    parse) and returns it (`exit_code` 0, 1 or 2). `only` narrows the checks by name.
    A folder that cannot take the report is exit 2 before anything runs."""
    start = time.perf_counter()
    report = Report(spec_text, run=this_run())
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
        stripped = "" if spec_text == spec_text.strip() else \
            f" (the SPEC {spec_text!r} without its surrounding spaces)"
        say(f"conform {spec}{stripped}")
        _run(spec, report, folder, seeds, bench, bench_quick, only, say)
    report.seconds["total"] = time.perf_counter() - start
    where = "; no report (the SPEC names no engine to file it under)"
    if folder is not None:
        try:
            where = f"; report in {write_report(report, folder)[1]}"
            replays = replay_files.write_replays(report, folder)
            if replays:
                where += (f" ({len(replays)} replay file{'s' * (len(replays) > 1)} beside "
                          f"it: *{replay_files.SUFFIX})")
        except OSError as exc:
            report.exit_code = EXIT_CANNOT_RUN
            where = f"; the report could not be written to {folder}: {exc}"
    say(f"{spec_text}: exit {report.exit_code}"
        + (f" ({report.reason.splitlines()[0]})" if report.reason else "") + where)
    return report


def _run(spec: EngineSpec, report: Report, folder: Path, seeds: int, bench: bool,
         bench_quick: bool, only: list[str] | None, say: Say) -> None:
    """The run itself, into `report` (mutated): its checks, its exit code and reason."""
    target: Target | None = None
    try:
        target = _open(spec, report, folder, say)
        chosen = [check_named(n) for n in only] if only else list(CHECKS)
        check_all(target, report, chosen, seeds, say)
        if bench or bench_quick:
            timed = time.perf_counter()
            report.bench = target.bench(bench_quick)
            report.seconds["bench"] = time.perf_counter() - timed
    except StubTouched as exc:
        report.exit_code = EXIT_CANNOT_RUN
        report.reason = _stub_reason(exc, report)
    except (CannotRun, UnsupportedVersion, LockError, InstallError, WorkerError,
            ResolveError, ValueError) as exc:
        report.exit_code = EXIT_CANNOT_RUN
        report.reason = str(exc)
    finally:
        if target is not None:
            target.close()


def replay_file(spec_text: str, path: Path, check: str | None = None,
                say: Say = print) -> int:
    """Re-run one finding on a fresh cache of `spec_text`'s engine: a replay file
    (`<check>.replay.json`), or a report.json and `check`, the name of one of its checks
    that did not pass (`harness.conform.controller.replay_file`). Every oracle judges
    every op and the family's own expectations are judged again; prints what was found.
    Exit 0 nothing (or only known limitations, said as such), 1 a violation or an unmet
    expectation, 2 the file is refused (the field named) or the engine could not run."""
    try:
        record = replay_files.load(path, check)
    except ValueError as exc:  # unreadable, too large, too deep, a bad field: exit 2
        say(f"kvharness conform --replay: {exc}")
        return EXIT_CANNOT_RUN
    report = Report(spec_text)
    target: Target | None = None
    folder = Path(tempfile.mkdtemp(prefix="kvharness-replay-"))
    try:
        spec = EngineSpec.parse(spec_text)
        target = _open(spec, report, folder, say)
        outcome = replay_files.replay(target, record)
    except (CannotRun, UnsupportedVersion, LockError, InstallError, WorkerError,
            ResolveError, ValueError) as exc:
        say(f"cannot replay on {spec_text}: {exc}")
        return EXIT_CANNOT_RUN
    finally:
        if target is not None:
            target.close()
    what = f"{record.check} ({record.oracle}), " if record.check else ""
    say(f"replaying {what}{len(record.ops)} ops on a pool of {record.num_blocks} blocks of "
        f"{record.block_size} tokens, {len(record.expectations)} expectations of the family")
    for note in outcome.notes:
        say(f"note: {note}")
    for i, op in enumerate(record.ops):
        say(f"  {i:>3} {op.describe()}")
    for v in outcome.violations:
        say(f"op {v.step} ({v.oracle}): {v.message}")
    for u in outcome.unmet:
        kind = "known limitation" if u.limitation else "expectation"
        say(f"op {u.step} ({kind}): {u.message}")
    failures = len(outcome.violations) + sum(u.limitation is None for u in outcome.unmet)
    limits = len(outcome.unmet) - sum(u.limitation is None for u in outcome.unmet)
    say(f"{failures} violations and unmet expectations" if failures else
        f"no violation; {limits} known limitations" if limits else "no violation")
    return EXIT_VIOLATION if outcome.failed else EXIT_PASSED


def write_lock(spec_text: str, lock_dir: Path = LOCK_DIR, say: Say = print) -> int:
    """`kvharness conform lock NAME==VERSION`: the release's lock (resolved now, or the one
    resolved at first use) written into `lock_dir` for committing. Exit 0 written (or
    committed already), 2 when it cannot be made (the reason said)."""
    try:
        spec = EngineSpec.parse(spec_text)
        check_engine(spec.engine)
        if spec.version is None or spec.path is not None:
            raise CannotRun(f"{spec_text}: name the release to lock ({spec.engine}==VERSION)")
        lock = release_lock(spec.engine, spec.version, cache_dir(), say)
    except (CannotRun, UnsupportedVersion, LockError, InstallError, WorkerError,
            ResolveError, ValueError) as exc:
        say(f"cannot lock {spec_text}: {exc}")
        return EXIT_CANNOT_RUN
    target = lock_dir / lock.path.name
    if lock.path.resolve() == target.resolve():
        say(f"{lock.spec} is locked already: {target}")
        return EXIT_PASSED
    target.write_bytes(lock.path.read_bytes())  # byte for byte: the venv's stamp holds
    resolved = lock.resolved or {}
    say(f"wrote {target} (resolved {resolved.get('date', '')} from "
        f"{base_of(lock.engine, resolved.get('base'))}); commit it")
    return EXIT_PASSED
