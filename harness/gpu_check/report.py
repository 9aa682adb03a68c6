"""The GPU check's results and their two forms: report.json (for tools) and report.md.

A CheckResult is one test: its outcome, seconds, the worst of its recorded comparisons
(max absolute error against its tolerance; the tests record them through
tests/gpu/support.Measure) and the kernel families its plans ran. A StageResult is
one stage's pytest process. Standard library only.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.reports.markdown import code, table

# stopped: killed at the time budget while it ran; crashed: its process ended while it
# ran (pytest-timeout, a CUDA fault); not run: never started (budget, crash, skip).
Outcome = Literal["passed", "failed", "error", "skipped", "stopped", "crashed", "not run"]
StageStatus = Literal["ran", "stopped", "ended early", "skipped"]
FAILING: frozenset[str] = frozenset({"failed", "error", "crashed"})
REPORT_JSON = "report.json"
REPORT_MD = "report.md"


def _value(text: object) -> Any:
    try:
        return json.loads(str(text))
    except ValueError:
        return text


@dataclass(frozen=True)
class CheckResult:
    """One test of the check (see the module docstring); err/tol come from its worst
    comparison, None when it recorded none."""

    stage: str
    test: str
    outcome: Outcome
    seconds: float
    max_abs_err: float | None = None
    tol: float | None = None
    worst: str | None = None
    kernels: tuple[str, ...] = ()
    notes: Mapping[str, Any] = field(default_factory=dict)
    message: str = ""

    @classmethod
    def from_properties(cls, stage: str, test: str, outcome: Outcome, seconds: float,
                        properties: Sequence[Sequence[Any]], message: str) -> CheckResult:
        """Fold a test's user properties: "check" (JSON what/max_abs_err/tol), "kernels",
        anything else a note (JSON when it parses)."""
        worst: dict[str, Any] | None = None
        kernels: list[str] = []
        notes: dict[str, Any] = {}
        for name, value in properties:
            if name == "check":
                check = _value(value)
                ratio = check["max_abs_err"] / check["tol"] if check["tol"] else float("inf")
                if worst is None or ratio > worst["ratio"]:
                    worst = {**check, "ratio": ratio}
            elif name == "kernels":
                if value not in kernels:
                    kernels.append(str(value))
            else:
                notes[str(name)] = _value(value)
        return cls(stage, test, outcome, seconds,
                   None if worst is None else float(worst["max_abs_err"]),
                   None if worst is None else float(worst["tol"]),
                   None if worst is None else str(worst["what"]), tuple(kernels), notes,
                   message)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kernels"] = list(self.kernels)
        return data


@dataclass(frozen=True)
class StageResult:
    """One stage: how its process ended, its seconds, why it stopped or was skipped."""

    name: str
    title: str
    status: StageStatus
    seconds: float
    reason: str
    checks: tuple[CheckResult, ...]

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["checks"] = [c.as_dict() for c in self.checks]
        return data


@dataclass(frozen=True)
class Report:
    """The whole check: environment, budget, stages in the order they ran."""

    environment: Mapping[str, str]
    budget_s: float
    elapsed_s: float
    stages: tuple[StageResult, ...]

    @property
    def checks(self) -> list[CheckResult]:
        return [c for s in self.stages for c in s.checks]

    @property
    def passed(self) -> bool:
        """No check failed, errored or crashed, and no stage's process ended early (budget
        skips and stops are not failures)."""
        return not any(c.outcome in FAILING for c in self.checks) and \
            all(s.status != "ended early" for s in self.stages)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(c.outcome for c in self.checks))

    @property
    def kernels(self) -> list[str]:
        """Every distinct kernel-family line the checks recorded, in order."""
        return list(dict.fromkeys(k for c in self.checks for k in c.kernels))

    def as_dict(self) -> dict[str, Any]:
        return {"result": "passed" if self.passed else "failed", "counts": self.counts,
                "budget_s": self.budget_s, "elapsed_s": round(self.elapsed_s, 1),
                "environment": dict(self.environment), "kernels": self.kernels,
                "stages": [s.as_dict() for s in self.stages]}

    def markdown(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items())) or "no checks"
        lines = [f"# GPU check: {'PASSED' if self.passed else 'FAILED'} ({counts}) in "
                 f"{self.elapsed_s:.0f} s of a {self.budget_s:.0f} s budget", ""]
        lines += [*table(list(self.environment), [list(self.environment.values())]), ""]
        lines += ["Kernel families that ran: "
                  + ("; ".join(f"`{k}`" for k in self.kernels) or "none recorded"), ""]
        stages = []
        for s in self.stages:
            tally = ", ".join(f"{n} {k}" for k, n in sorted(Counter(
                c.outcome for c in s.checks).items())) or "-"
            stages.append([s.name, s.status, tally, f"{s.seconds:.1f}", s.reason])
        lines += ["## Stages", "", *table(["stage", "status", "checks", "s", "note"], stages)]
        checks = [[c.stage, code(c.test.split("::", 1)[-1]), c.outcome,
                   "" if c.max_abs_err is None else f"{c.max_abs_err:.3g}",
                   "" if c.tol is None else f"{c.tol:.3g}", c.worst or "", "; ".join(c.kernels),
                   f"{c.seconds:.2f}"] for c in self.checks]
        lines += ["", "## Checks", "", "max abs err and tol: the test's worst comparison "
                  "(by err / tol) against the float32 torch reference or the eager run.", "",
                  *table(["stage", "check", "result", "max abs err", "tol", "worst comparison",
                          "kernels", "s"], checks)]
        problems = [c for c in self.checks if c.outcome != "passed"]
        if problems:
            lines += ["", "## Not passed", ""]
            lines += [f"- {c.outcome}: `{c.test}`: {_one_line(c.message) or 'no message'}"
                      for c in problems]
        return "\n".join(lines) + "\n"

    def write(self, results: Path) -> None:
        """Write report.json and report.md into `results` (created if needed)."""
        results.mkdir(parents=True, exist_ok=True)
        (results / REPORT_JSON).write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        (results / REPORT_MD).write_text(self.markdown())


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")
