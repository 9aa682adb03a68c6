"""A conformance run's results, written as report.json and report.md.

report.json has everything (per check: name, family, oracle, status, message, the op
list that shows a failure, shrunk, and the engine's counters at the end); report.md is
the same for a reader: the contract, the self-test, a table of checks, each finding
with its op list, the benchmark and the times. See docs/conformance.md, "Reading the
report".
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.reports.markdown import code, table

Status = Literal["pass", "fail", "skip"]
EXIT_PASSED, EXIT_VIOLATION, EXIT_CANNOT_RUN = 0, 1, 2


@dataclass(frozen=True)
class CheckResult:
    """One check. `oracle` names what failed ("scenario" for an expectation of the
    family; every oracle ran either way); `ops` the op list that shows it (shrunk for
    an oracle's finding), as JSON, on a fresh cache of `num_blocks` blocks opened with
    `options` (`CacheOptions.as_dict`; the object replays as it is: `kvharness conform
    SPEC --replay FILE`); `also` the other findings of the same run."""

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
    options: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    observed: dict[str, Any] = field(default_factory=dict)
    also: tuple[str, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """A whole run; `exit_code` 0 all passed, 1 a violation found, 2 could not run
    (`reason` says why)."""

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

    @property
    def failed(self) -> list[CheckResult]:
        """The checks that found something."""
        return [c for c in self.checks if c.status == "fail"]

    def as_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return asdict(self)


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
    if report.exit_code == EXIT_PASSED:
        if skipped:
            return (f"**passed** (exit 0): {n - skipped} checks; {skipped} skipped (the "
                    "engine's contract cannot be judged by them: see Checks)")
        return f"**passed** (exit 0): all {n} checks"
    return f"**violations found** (exit 1): {len(report.failed)} of {n} checks failed"


def markdown(report: Report) -> list[str]:
    """The report.md lines."""
    title = f"{report.engine} {report.version}".strip() or report.spec
    out = [f"# Conformance: {title}", "", _verdict(report), ""]
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
    for c in report.failed:
        out += [f"## Finding: {c.name} ({c.oracle})", "", "```", c.message, "```", "",
                f"Op list ({len(c.ops)} of the {c.num_ops} ops the check ran, on "
                f"{c.num_blocks} blocks"
                + (f", opened with {json.dumps(c.options)}" if c.options else "")
                + "):", "", "```"]
        out += [*c.ops_text, "```", ""]
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
