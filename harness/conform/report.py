"""A conformance run's results, written as report.json and report.md.

report.json has everything (per check: name, family, oracle, status, message, the op
list that shows a failure, shrunk, and the engine's counters at the end); report.md is
the same for a reader: the contract, the self-test, a table of checks, each finding
with its op list, the benchmark and the times. See docs/conformance.md, "Reading the
report".
"""

from __future__ import annotations

import json
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
    an oracle's finding), as JSON, on a fresh cache of `num_blocks` blocks (the object
    replays as it is: `kvharness conform SPEC --replay FILE`); `also` the other
    findings of the same run."""

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
    seconds: float = 0.0
    observed: dict[str, Any] = field(default_factory=dict)
    also: tuple[str, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """A whole run; `exit_code` 0 all passed, 1 a violation found, 2 could not run
    (`reason` says why). `source`: where the engine came from (a release's lock,
    committed or resolved and how; a source tree; the interpreter's own install);
    `contract_basis`: the known release whose contract the run used and the fields
    detected in the engine's code. Every timing is a key named `seconds` (the run's
    steps: install, import, self_test, checks, bench, total; each check's; the
    install's and the worker's import), and nothing else is: two runs of one release
    write the same report.json once those keys are dropped (and `bench`, a measurement)."""

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
    source: dict[str, Any] = field(default_factory=dict)
    contract_basis: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[CheckResult]:
        """The checks that found something."""
        return [c for c in self.checks if c.status == "fail"]

    def as_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return asdict(self)


def write_report(report: Report, folder: Path) -> tuple[Path, Path]:
    """Write report.json and report.md into `folder` (created); returns both paths."""
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
    if report.exit_code == EXIT_PASSED:
        return f"**passed** (exit 0): all {n} checks"
    return f"**violations found** (exit 1): {len(report.failed)} of {n} checks failed"


def _source(report: Report) -> list[str]:
    """Where the engine came from and what its contract rests on."""
    src, basis = report.source, report.contract_basis
    out: list[str] = []
    if src.get("kind") == "release":
        resolved = src.get("resolved")
        out.append(f"Lock: {code(str(src.get('lock')))}, committed" if src.get("committed")
                   else f"Lock: {code(str(src.get('lock')))}, **unlocked** (resolved "
                   f"{resolved.get('date') if resolved else '?'} from "
                   f"{report.engine} {resolved.get('base') if resolved else '?'}'s lock: "
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
            for k, v in report.contract.items() if k not in ("citations", "notes")]
        out += [*table(("field", "value"), rows), ""]
        for what, where in report.contract.get("citations", ()):
            out.append(f"- {what}: {where}")
        out += [f"- note: {n}" for n in report.contract.get("notes", ())] + [""]
    if report.self_test:
        problems = report.self_test.get("problems", [])
        out += ["## Self-test", "",
                "passed" if not problems else "**refused**: " + "; ".join(problems),
                f"({len(report.self_test.get('sources', {}))} engine functions checked, "
                f"{report.self_test.get('substitutes', 0)} substitutes refused)", ""]
    if report.checks:
        out += ["## Checks", ""]
        rows = [(c.name, c.family, c.status, c.oracle or "all", f"{c.seconds:.2f}",
                 c.message.splitlines()[0][:160] if c.message else "")
                for c in report.checks]
        out += [*table(("check", "family", "result", "oracle", "s", "message"), rows), ""]
    for c in report.failed:
        out += [f"## Finding: {c.name} ({c.oracle})", "", "```", c.message, "```", "",
                f"Op list ({len(c.ops)} of the {c.num_ops} ops the check ran):", "", "```"]
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
