"""Benchmark summary: `python -m benchmarks.report RESULTS_DIR [--json FILE ...]`.

Reads pytest-benchmark JSON (every *.json in RESULTS_DIR that is one, or the --json
files) through `harness.reports.bench_results`, the reader `kvharness report` uses too, and
writes RESULTS_DIR/summary.md with the headline numbers and ratios (cache-core tokens/s
against the baseline trie and docs/design.md's targets, metadata build against one
copy_, TTFT warm / cold / ideal, hit-rate curves, memory, GPU figures) and PNG plots
(see benchmarks.report_plots). Each suite declares its own sections (a `SECTIONS` tuple
in its benchmarks/test_bench_*.py, see benchmarks.report_format); sections whose
benchmarks did not run are left out.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.conftest import library_versions
from benchmarks.report_format import Section, other_section, render
from harness.reports.bench_results import Benchmark, find_bench_json, load_bench_json

SUMMARY = "summary.md"
SUITES = Path(__file__).resolve().parent  # benchmarks/test_bench_*.py declare SECTIONS


def sections() -> tuple[Section, ...]:
    """Every section the suites declare (`SECTIONS` in each benchmarks/test_bench_*.py),
    in file-name order, then in each file's order. Imports the suites (torch with them)."""
    found: list[Section] = []
    for path in sorted(SUITES.glob("test_bench_*.py")):
        found += getattr(importlib.import_module(f"benchmarks.{path.stem}"), "SECTIONS", ())
    return tuple(found)


@dataclass(frozen=True)
class Results:
    """Benchmarks of one or more JSON files, with the first file's run description."""

    benches: tuple[Benchmark, ...]
    machine: Mapping[str, Any]
    commit: Mapping[str, Any]
    datetime: str
    sources: tuple[Path, ...]


def load(results_dir: Path, files: Sequence[Path] = ()) -> Results:
    """Benchmarks of `files`, or of every pytest-benchmark JSON in `results_dir`.

    Raises ValueError naming the file when a given file is unreadable or not
    pytest-benchmark JSON, when a JSON file in `results_dir` is not JSON or a benchmark
    JSON there is of the wrong shape (see `harness.reports.bench_results`), or when no benchmark
    JSON is found at all.
    """
    runs = [load_bench_json(p) for p in files] if files else find_bench_json(results_dir)
    if not runs:
        raise ValueError(f"no pytest-benchmark JSON found in {results_dir}/*.json")
    head = runs[0]
    return Results(tuple(b for run in runs for b in run.benchmarks), head.machine,
                   head.commit, head.datetime, tuple(run.source for run in runs))


def machine_section(res: Results) -> list[str]:
    """Where and with what the numbers were measured."""
    m = res.machine
    cpu = m.get("cpu") or {}
    libs = m.get("libraries")
    libs_note = ""
    if not isinstance(libs, dict):  # JSON written without benchmarks/conftest.py's hook
        libs, libs_note = library_versions(), " (read when the report was written)"
    commit = res.commit
    lines = ["## Machine", "",
             f"- when: {res.datetime}; commit {str(commit.get('id', '?'))[:12]}"
             f"{' (dirty)' if commit.get('dirty') else ''} on {commit.get('branch', '?')}",
             f"- cpu: {cpu.get('brand_raw', '?')}, {cpu.get('count', '?')} cores; "
             f"{m.get('system', '?')} {m.get('release', '')}; "
             f"python {m.get('python_version', '?')}",
             f"- gpu: {m.get('cuda_device') or 'none'}; torch threads: "
             f"{m.get('torch_num_threads', '?')}; quick mode: {m.get('bench_quick', '?')}",
             "- libraries" + libs_note + ": "
             + ", ".join(f"{k} {v}" for k, v in sorted(libs.items())),
             f"- sources: {', '.join(p.name for p in res.sources)}", ""]
    return lines


def summarize(res: Results, plots: Mapping[str, Path], problems: Sequence[str] = ()) -> str:
    """The markdown summary; `plots` maps a plot's title to its file (linked), `problems`
    lists plots that could not be drawn."""
    body: list[str] = []
    left = list(res.benches)
    for section in sections():
        mine = [b for b in left if section.claims(b)]
        if mine:
            body += render(section, mine)
            left = [b for b in left if not section.claims(b)]
    if left:
        body += other_section(left)
    figures = [f"![{title}]({path.name})" for title, path in plots.items()]
    figures += [f"- {line}" for line in problems]
    return "\n".join(["# Benchmark summary", "", *machine_section(res), *body,
                      *(["## Plots", "", *figures, ""] if figures else [])])


def write_report(results_dir: Path, files: Sequence[Path] = ()) -> list[Path]:
    """Write summary.md and the plots into `results_dir`; returns the paths written.

    Raises ValueError as `load` does.
    """
    from benchmarks.report_plots import write_plots

    res = load(results_dir, files)
    results_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(res.benches, results_dir)
    summary = results_dir / SUMMARY
    summary.write_text(summarize(res, plots.paths, plots.problems))
    return [summary, *plots.paths.values()]


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad input)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    parser.add_argument("results_dir", type=Path, help="folder to read JSON from and write to")
    parser.add_argument("--json", type=Path, action="append", default=[], metavar="FILE",
                        help="pytest-benchmark JSON to read (repeatable); default: "
                        "every benchmark JSON in RESULTS_DIR")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.results_dir, args.json)
    except ValueError as exc:
        print(f"benchmarks.report: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
