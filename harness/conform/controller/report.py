"""A conformance run's results, written as report.json and report.md.

report.json has everything (per check: name, family, oracle, status, message, the op
list that shows a failure, shrunk, and the engine's counters at the end); report.md is
the same for a reader: the contract, the self-test, a table of checks, each finding
with its op list, the benchmark and the times. See docs/conformance.md, "Reading the
report".
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from harness.conform.controller.locks import base_of
from harness.reports.markdown import code, table

Status = Literal["pass", "fail", "limitation", "skip"]
Verdict = Literal["passed", "known limitations", "violations", "could not run"]
# A run whose only non-passes are known limitations exits 0, as a clean pass does: the
# exit code answers "did this run find anything upstream has not acknowledged?" (a CI job
# on a branch must not go red for an open RFC). Its report says "known limitations",
# never "passed", and so does the matrix (report.json: `verdict`).
EXIT_PASSED, EXIT_VIOLATION, EXIT_CANNOT_RUN = 0, 1, 2


@dataclass(frozen=True)
class CheckResult:
    """One check. `status`: pass, fail, limitation (an expectation of the family did not
    hold only as far as a known limitation of the contract goes, upstream's link in the
    message) or skip. `oracle` names what failed ("scenario" for an expectation of the
    family; every oracle ran either way); `ops` the op list that shows it (shrunk for
    an oracle's finding), as JSON, on a fresh cache of `num_blocks` blocks of
    `block_size` tokens opened with `options` (`CacheOptions.as_dict`), and `step` the
    index in it of the op where it shows; `expectations` the family's declared
    expectations over `ops` (`harness.conform.controller.expectations`) where `ops` is
    the whole op list they were declared over (a scenario failure or a known
    limitation), so a replay judges them again; `known` the finding the harness already
    knows that this is (`harness.conform.controller.known_findings`: its number,
    upstream issue, fix and first fixed release), else empty; `limitation` the upstream
    link of a known limitation; `also` the other findings of the same run; `went_through`
    the engine functions (`path: Qualified.name`) the op at `step` calls on a cache
    opened as this one was (`Target.engine_code`), None where the adapter does not say;
    `contract` the contract (`Contract.as_dict`) of a check that did not pass and whose
    cache was opened with `options` (empty: the report's own contract holds). A check
    that did not pass is written beside the report as its own replay file too
    (`harness.conform.controller.replay_file`)."""

    name: str
    family: str
    about: str
    status: Status
    oracle: str = ""
    message: str = ""
    ops: tuple[dict[str, Any], ...] = ()
    ops_text: tuple[str, ...] = ()
    num_ops: int = 0
    num_blocks: int = 0
    block_size: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    expectations: tuple[dict[str, Any], ...] = ()
    known: dict[str, Any] = field(default_factory=dict)
    limitation: str = ""
    seconds: float = 0.0
    observed: dict[str, Any] = field(default_factory=dict)
    also: tuple[str, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)
    went_through: tuple[str, ...] | None = None
    contract: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """A whole run; `exit_code` 0 all passed or only known limitations, 1 a violation
    found, 2 could not run (`reason` says why); `verdict` tells the first two apart.
    `run`: the day it ran (UTC) and the machine (`this_run`), which the version matrix
    shows. `source`: where the engine came from (a release's lock, committed or resolved
    and how; a source tree; the interpreter's own install; `overrides`: the dependency
    checks the worker answered itself, `stubs.OVERRIDES`); `contract_basis`: the known
    release whose contract the run used and the fields detected in the engine's code.
    Every timing is a key named `seconds` (the run's steps: install, import, self_test,
    checks, bench, total; each check's; the install's and the worker's import), and
    nothing else is: two runs of one release write the same report.json once those keys
    are dropped (and `bench`, a measurement, and `run`, the day and machine)."""

    spec: str
    engine: str = ""
    version: str = ""
    exit_code: int = EXIT_CANNOT_RUN
    reason: str = ""
    contract: dict[str, Any] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    install: dict[str, Any] = field(default_factory=dict)
    self_test: dict[str, Any] = field(default_factory=dict)
    checks: list[CheckResult] = field(default_factory=list)
    bench: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    run: dict[str, str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    contract_basis: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[CheckResult]:
        """The checks that found a violation."""
        return [c for c in self.checks if c.status == "fail"]

    @property
    def limited(self) -> list[CheckResult]:
        """The checks that found only a known limitation."""
        return [c for c in self.checks if c.status == "limitation"]

    @property
    def verdict(self) -> Verdict:
        """What the run found, in the words the report and the matrix use."""
        if self.exit_code == EXIT_CANNOT_RUN:
            return "could not run"
        if self.failed:
            return "violations"
        return "known limitations" if self.limited else "passed"

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (with `verdict`)."""
        return {**asdict(self), "verdict": self.verdict}


def this_run() -> dict[str, str]:
    """Today's date (UTC) and this machine, as a report's `run` records them."""
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
               f"Python {platform.python_version()}")
    return {"date": datetime.now(UTC).date().isoformat(), "machine": machine}


class ReportFolderError(ValueError):
    """The report cannot be written where it was asked for; the message names the folder."""


REPORT_FILES = ("report.json", "report.md")


def _shown(path: Path) -> str:
    text = str(path)
    return text if len(text) <= 200 else f"{text[:120]}... ({len(text)} characters)"


def prepare_folder(folder: Path) -> None:
    """Make `folder` ready for `write_report` before anything runs, so no result is lost
    to a folder that cannot hold them: created if missing (mutates the file system), a
    folder, writable, and its report files, where present, files. Raises
    ReportFolderError naming the folder (a file there, a parent that is a file, a name
    too long, no permission)."""
    where = f"report folder {_shown(folder)}"
    try:
        if folder.exists() and not folder.is_dir():
            raise ReportFolderError(f"{where}: is a file, not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        for name in REPORT_FILES:
            if (folder / name).exists() and not (folder / name).is_file():
                raise ReportFolderError(f"{where}: {name} is not a file")
        with tempfile.TemporaryFile(dir=folder):
            pass  # a file can be made there
    except OSError as exc:
        raise ReportFolderError(f"{where}: {exc.strerror or exc}") from None


def write_report(report: Report, folder: Path) -> tuple[Path, Path]:
    """Write report.json and report.md into `folder` (created); returns both paths.
    Raises OSError when they cannot be written (`prepare_folder` checks first)."""
    folder.mkdir(parents=True, exist_ok=True)
    as_json = folder / "report.json"
    as_md = folder / "report.md"
    as_json.write_text(json.dumps(report.as_dict(), indent=1, default=str) + "\n",
                       encoding="utf-8")
    as_md.write_text("\n".join(markdown(report)) + "\n", encoding="utf-8")
    return as_json, as_md


def _verdict(report: Report) -> str:
    if report.exit_code == EXIT_CANNOT_RUN:
        return f"**could not run** (exit 2): {report.reason}"
    n = len(report.checks)
    skipped = sum(c.status == "skip" for c in report.checks)
    if report.exit_code == EXIT_PASSED and report.limited:
        return (f"**known limitations** (exit 0): no violation; {len(report.limited)} of {n} "
                "checks found only behaviour upstream has acknowledged and not fixed (see "
                "each Known limitation and its link)"
                + (f"; {skipped} skipped" if skipped else ""))
    if report.exit_code == EXIT_PASSED:
        if skipped:
            return (f"**passed** (exit 0): {n - skipped} checks; {skipped} skipped (the "
                    "engine's contract cannot be judged by them: see Checks)")
        return f"**passed** (exit 0): all {n} checks"
    return f"**violations found** (exit 1): {len(report.failed)} of {n} checks failed"


def _went_through(c: CheckResult) -> list[str]:
    """The engine code the op where `c` shows went through, file by file (what the
    adapter said of the cache it ran on); [] where the report does not say."""
    if c.step is None or not 0 <= c.step < len(c.ops) or c.went_through is None:
        return []
    by_file: dict[str, list[str]] = {}
    for function in c.went_through:
        path, _, qualname = function.partition(": ")
        by_file.setdefault(path, []).append(qualname)
    where = "; ".join(f"{code(path)}: {', '.join(q)}" for path, q in by_file.items())
    return [f"- the failing op, {code(c.ops_text[c.step])}, goes through "
            + (where or "no engine function (the adapter's own bookkeeping)"), ""]


def _known(known: dict[str, Any]) -> list[str]:
    """What upstream said of a known finding; [] for one the harness does not know."""
    if not known:
        return []
    links = [f"issue {known['issue']}" if known.get("issue") else "no upstream issue",
             f"fix {known['fix']}" if known.get("fix") else "no fix linked",
             f"first fixed in {known['fixed_in']}" if known.get("fixed_in")
             else "not fixed in any release run"]
    return [f"- known: finding {known['number']} of docs/conformance.md, "
            f"{known['title']}: {'; '.join(links)}", ""]


def _source(report: Report) -> list[str]:
    """Where the engine came from and what its contract rests on."""
    src, basis = report.source, report.contract_basis
    out: list[str] = []
    if src.get("kind") == "release":
        resolved = src.get("resolved")
        out.append(f"Lock: {code(str(src.get('lock')))}, committed" if src.get("committed")
                   else f"Lock: {code(str(src.get('lock')))}, **unlocked** (resolved "
                   f"{resolved.get('date') if resolved else '?'} from "
                   f"{base_of(report.engine, resolved.get('base') if resolved else None)}"
                   "'s lock: "
                   f"{resolved.get('how') if resolved else ''}"
                   + (f"; added {', '.join(resolved['added'])}" if resolved and
                      resolved.get("added") else "") + ")")
    elif src.get("kind") == "tree":
        out.append(f"Source tree: {code(str(src.get('path')))} (version from "
                   f"{src.get('version_from')}; pins and stubs of "
                   f"{code(str(src.get('pins_and_stubs_from')))})")
    elif src.get("kind") == "installed":
        out.append(f"Installed in {code(str(src.get('interpreter')))} (stubs of "
                   f"{code(str(src.get('stubs_from')))})")
    for key, what in src.get("overrides", {}).items():
        out.append(f"Override {code(key)} (the lock's `stubs.overrides`): {what}")
    if basis and basis.get("known") != basis.get("version"):
        detected = basis.get("detected", {})
        out.append(f"Contract: {report.engine} {basis.get('known')}'s (the nearest release "
                   "with a contract); detected in this release: "
                   + ("; ".join(f"{k} ({v})" for k, v in detected.items()) or "nothing"))
    return [*out, ""] if out else []


def markdown(report: Report) -> list[str]:
    """The report.md lines."""
    title = f"{report.engine} {report.version}".strip() or report.spec
    out = [f"# Conformance: {title}", "", _verdict(report), ""]
    out += _source(report)
    if report.contract:
        out += ["## Contract", ""]
        rows: list[tuple[object, ...]] = [
            (k, json.dumps(v) if not isinstance(v, str) else v)
            for k, v in report.contract.items()
            if k not in ("citations", "notes", "replicated")]
        out += [*table(("field", "value"), rows), ""]
        for what, where in report.contract.get("citations", ()):
            out.append(f"- {what}: {where}")
        out += [f"- note: {n}" for n in report.contract.get("notes", ())] + [""]
        replicated = report.contract.get("replicated", ())
        if replicated:  # what a pass does not prove
            out += ["What the adapter does itself instead of running the engine's code:", ""]
            out += [f"- {what}; the engine's: {where} ({why})"
                    for what, where, why in replicated] + [""]
    if report.self_test:
        problems = report.self_test.get("problems", [])
        out += ["## Self-test", "",
                "passed" if not problems else "**refused**: " + "; ".join(problems),
                f"({len(report.self_test.get('sources', {}))} engine functions checked, "
                f"{report.self_test.get('substitutes', 0)} substitutes refused)", ""]
    if report.checks:
        out += ["## Checks", ""]
        rows = [(c.name, c.family, c.status,
                 c.oracle or ("-" if c.status == "skip" else "all"), f"{c.seconds:.2f}",
                 c.message.splitlines()[0][:160] if c.message else "")
                for c in report.checks]
        out += [*table(("check", "family", "result", "oracle", "s", "message"), rows), ""]
    for c in report.failed + report.limited:
        head = "Finding" if c.status == "fail" else "Known limitation"
        out += [f"## {head}: {c.name} ({c.oracle})", "", "```", c.message, "```", "",
                f"Op list ({len(c.ops)} of the {c.num_ops} ops the check ran, on a fresh "
                f"cache of {c.num_blocks} block{'' if c.num_blocks == 1 else 's'} of "
                f"{c.block_size} tokens"
                + (f", opened with {json.dumps(c.options)}" if c.options else "")
                + "; it replays: "
                f"{code(f'kvharness conform {report.spec.strip()} --replay {c.name}.replay.json')}"
                " (the file beside this report)"
                + (f", which judges the family's {len(c.expectations)} expectations too"
                   if c.expectations else "") + "):", "", "```"]
        out += [f"{text}    <- {c.oracle} here" if i == c.step else text
                for i, text in enumerate(c.ops_text)]
        out += ["```", ""]
        out += _went_through(c) + _known(c.known)
        out += [f"- also: {a}" for a in c.also] + ([""] if c.also else [])
    if report.bench:
        out += ["## Speed (tokens/s, same process)", ""]
        rows = [(b["workload"], b["phase"], b["adapter"], b["tokens"],
                 f"{b['tokens_per_s']:.3g}") for b in report.bench]
        out += [*table(("workload", "phase", "adapter", "tokens", "tokens/s"), rows), ""]
    if report.seconds:
        out += ["## Times", ""]
        out += table(("step", "s"), [(k, f"{v:.1f}") for k, v in report.seconds.items()])
    if report.worker:
        out += ["", f"Worker: {code(json.dumps(report.worker, default=str))}"]
    return out
