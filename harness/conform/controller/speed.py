"""The speed table of `nox -s bench`: every pinned engine already installed, side by side
with kvcache (skipped otherwise), measured by the worker's `run_bench`
(`harness.conform.worker.bench`) through `kvharness conform SPEC --bench`.

`python -m harness.conform.controller.speed RESULTS_DIR [--quick]` writes it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.conform.controller.install import installed
from harness.conform.controller.locks import find_lock
from harness.conform.controller.runner import conform
from harness.reports.markdown import table

PINNED = ("vllm==0.33.0", "sglang==0.5.23")


def section(results: Path, quick: bool, say: Callable[[str], None] = print) -> list[str]:
    """The speed comparison for `nox -s bench`: every pinned engine whose cached install
    exists runs `kvharness conform SPEC --bench` (its report under
    results/conformance-<engine>); returns the markdown section (a line saying none was
    installed otherwise). Installs nothing."""
    lines = ["## Prefix caches side by side (kvharness conform --bench)", ""]
    ran = False
    for spec in PINNED:
        engine, version = spec.split("==")
        if installed(find_lock(engine, version)) is None:
            say(f"conformance bench: {spec} is not installed; skipped "
                f"(kvharness conform {spec} installs it)")
            continue
        ran = True
        report = conform(spec, results / f"conformance-{engine}", seeds=0,
                         bench=not quick, bench_quick=quick, only=["cold_then_warm"], say=say)
        lines += [f"### {spec}", ""]
        lines += _speed_table(report.bench) if report.bench else [f"not run: {report.reason}"]
        lines.append("")
    if not ran:
        lines.append("skipped: no engine is installed (`kvharness conform vllm==0.33.0` "
                     "installs one)")
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
    RESULTS_DIR/conformance.md (see `section`)."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m harness.conform.controller.speed RESULTS_DIR [--quick]",
              file=sys.stderr)
        return 2
    results = Path(args[0])
    lines = section(results, "--quick" in args[1:])
    results.mkdir(parents=True, exist_ok=True)
    (results / "conformance.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
