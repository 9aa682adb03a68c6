"""The speed table of `nox -s bench`: each pinned engine (`locks.pinned`) whose cached
install exists, side by side with kvcache (skipped otherwise), measured by the worker's
`run_bench` (`harness.conform.worker.bench`) through `kvharness conform SPEC --bench`.

`python -m harness.conform.controller.speed RESULTS_DIR [--quick]` writes it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.conform.controller.install import installed
from harness.conform.controller.locks import DEFAULT_PYTHON, pinned, python_tag, supported
from harness.conform.controller.runner import conform
from harness.reports.markdown import table


def section(quick: bool, say: Callable[[str], None] = print) -> list[str]:
    """The speed comparison for `nox -s bench`: every pinned engine whose cached install
    exists runs `kvharness conform SPEC --bench` (its report in its own folder,
    results/conform/ENGINE-VERSION); returns the markdown section (a line saying none was
    installed otherwise). Installs nothing."""
    lines = ["## Prefix caches side by side (kvharness conform --bench)", ""]
    ran = False
    locks = pinned()
    for engine, versions in supported(python=DEFAULT_PYTHON).items():
        if versions and engine not in {lock.engine for lock in locks}:
            say(f"conform bench: {engine}=={versions[-1]} skipped: no lock committed for "
                f"Python {python_tag()}")
    for lock in locks:
        if installed(lock) is None:
            say(f"conform bench: {lock.spec} is not installed; skipped "
                f"(kvharness conform {lock.spec} installs it)")
            continue
        ran = True
        report = conform(lock.spec, None, seeds=0, bench=not quick, bench_quick=quick,
                         only=["cold_then_warm"], say=say)
        lines += [f"### {lock.spec}", ""]
        lines += _speed_table(report.bench) if report.bench else [f"not run: {report.reason}"]
        lines.append("")
    if not ran:
        lines.append(f"skipped: no engine is installed (`kvharness conform {locks[0].spec}` "
                     "installs one)" if locks else
                     f"skipped: no engine has a lock committed for Python {python_tag()}")
    return lines


def _speed_table(rows: list[dict[str, Any]]) -> list[str]:
    by: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        by.setdefault((r["workload"], r["phase"]), {})[r["adapter"].split()[0]] = \
            r["tokens_per_s"]
    engines = sorted({a for d in by.values() for a in d} - {"kvcache"})
    header = ("workload", "phase", "kvcache tokens/s", *(f"{e} tokens/s" for e in engines),
              *(f"kvcache / {e}" for e in engines))
    body = [(w, p, f"{d['kvcache']:.3g}", *(f"{d[e]:.3g}" for e in engines),
             *(f"{d['kvcache'] / d[e]:.1f}x" for e in engines)) for (w, p), d in by.items()]
    return table(header, body)


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.conform.controller.speed RESULTS_DIR [--quick]`: write
    RESULTS_DIR/conform.md (see `section`)."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m harness.conform.controller.speed RESULTS_DIR [--quick]",
              file=sys.stderr)
        return 2
    results = Path(args[0])
    lines = section("--quick" in args[1:])
    results.mkdir(parents=True, exist_ok=True)
    (results / "conform.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
