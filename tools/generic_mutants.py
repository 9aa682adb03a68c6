"""Generic operator mutation of the cache core with mutmut: every mutation mutmut makes
(operators, comparisons, constants, arguments, return values, dropped calls) in every
function of `kvcache/core`, against the cache's own tests, as the catalogue
(tools/mutants.py) cannot: it mutates what nobody thought of.

    python tools/generic_mutants.py                                 # all of kvcache/core
    python tools/generic_mutants.py --only 'kvcache/core/stats.py'  # some files (globs)
    nox -s mutants -- generic                                       # the same, in nox

It runs in a temporary copy of the checkout (tools/mutants.py's Workspace), whose
pyproject gets the `[tool.mutmut]` table below; the checkout is never touched (an
`--only` glob or `--tests` path that is absolute, climbs with `..` or leads out through
a symlink is refused first, as is a glob that selects nothing). mutmut
runs the selected tests once to learn which tests call each function, then each mutant
in a forked child against the tests that call its function, fastest first, stopping at
the first failure. The report (generic.json, generic.md in --out): each mutant's status
by mutmut's own names (killed, survived, no tests: no selected test calls the function,
timeout, ...), counts per file, the score, and a diff of each survivor. A survivor is a
behaviour of the core that no selected test pins down: it wants a test, unless no test
could tell it from the original (an equivalent mutant). mutmut forks its children from a
process that has run tests, so they run with one OpenMP thread (a forked OpenMP pool
hangs).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mutants import RESULTS, ROOT, Workspace, inside

SOURCE = "kvcache/"  # copied whole into mutmut's tree, so `kvcache` resolves there
MUTATE = ("kvcache/core/*",)  # what is mutated: the pure-Python core
# The cache's own tests: the core's unit tests, the oracles (the checked manager, the
# event index, the differential oracle), the reuse assertions and the cache fuzzer.
# About 30 s serially; every mutant runs a subset of them.
TESTS = ("tests/unit/core", "tests/harness/oracle", "tests/harness/reuse",
         "tests/reliability/test_cache_fuzz.py")
PYTEST_ARGS = ("-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:benchmark", "-q")
ALSO_COPY = ("harness", "tools", "test_lists")  # what the tests import or read besides
# Mutant statuses that are a test's verdict (the score's denominator); the others
# (skipped, not checked) are not.
KILLED = ("killed", "timeout", "segfault", "caught by type check")
COUNTED = (*KILLED, "survived", "no tests", "suspicious")


def _toml_list(values: Sequence[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def mutmut_table(only: Sequence[str], tests: Sequence[str] = ()) -> str:
    """The `[tool.mutmut]` table for the workspace's pyproject: mutate `only` (globs
    under kvcache/core; default all of it) against `tests` (default TESTS)."""
    return "\n".join([
        "", "[tool.mutmut]",
        f"source_paths = {_toml_list([SOURCE])}",
        f"only_mutate = {_toml_list(only or MUTATE)}",
        f"pytest_add_cli_args_test_selection = {_toml_list(tests or TESTS)}",
        f"pytest_add_cli_args = {_toml_list(PYTEST_ARGS)}",
        f"also_copy = {_toml_list(ALSO_COPY)}", ""])


def mutated_files(root: Path, glob: str) -> list[str]:
    """The files of `root` an `--only` glob mutates, as mutmut matches it (fnmatch: `*`
    spans folders; only .py files under SOURCE are walked). Raises ValueError naming the
    glob when it is absolute, climbs with `..`, selects nothing, or selects a file that
    resolves outside `root` (a symlink out)."""
    inside(root, glob)  # absolute, or `..`: refused whatever it matches
    found = sorted(str(f.relative_to(root)) for f in (root / SOURCE).rglob("*.py")
                   if fnmatch.fnmatch(str(f.relative_to(root)), glob))
    if not found:
        raise ValueError(f"{glob!r} matches no .py file under {SOURCE} (mutmut walks only "
                         "that folder)")
    for file in found:
        inside(root, file)
    return found


def configure(workspace: Path, only: Sequence[str], tests: Sequence[str] = ()) -> None:
    """Append the mutmut table to the workspace's pyproject (refused if it has one)."""
    pyproject = workspace / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    if "[tool.mutmut]" in text:
        raise SystemExit(f"{pyproject}: already has a [tool.mutmut] table; this tool writes "
                         "its own")
    pyproject.write_text(text + mutmut_table(only, tests), encoding="utf-8")


def read_results() -> list[dict[str, Any]]:
    """In a mutmut workspace (the current directory): every mutant's name, file and
    status, and a survivor's diff, through mutmut's own reader."""
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files

    rows = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        for name, code in sorted(data.exit_code_by_key.items()):
            status = status_by_exit_code[code]
            rows.append({"name": name, "file": str(path), "status": status,
                         "diff": get_diff_for_mutant(name, path=path)
                         if status == "survived" else None})
    return rows


def summary(rows: Sequence[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Counts by status, overall and per file; the score (killed of counted); the rate."""
    by_file: dict[str, Counter[str]] = {}
    for row in rows:
        by_file.setdefault(row["file"], Counter())[row["status"]] += 1
    total: Counter[str] = sum(by_file.values(), Counter())
    killed = sum(total[s] for s in KILLED)
    counted = sum(total[s] for s in COUNTED)
    return {"mutants": len(rows), "by_status": dict(total), "killed": killed,
            "counted": counted, "score": killed / counted if counted else None,
            "seconds": seconds, "mutants_per_second": len(rows) / seconds if seconds else None,
            "by_file": {f: dict(c) for f, c in sorted(by_file.items())}}


def write_report(rows: Sequence[dict[str, Any]], figures: dict[str, Any], out: Path,
                 tests: Sequence[str] = TESTS) -> None:
    """generic.json and generic.md in `out`; `tests`: the selection the mutants ran against."""
    from harness.reports.markdown import code, table

    out.mkdir(parents=True, exist_ok=True)
    (out / "generic.json").write_text(json.dumps({"summary": figures, "mutants": rows},
                                                 indent=1))
    score = "-" if figures["score"] is None else f"{figures['score']:.1%}"
    lines = ["# Generic operator mutation of kvcache/core (mutmut)", "",
             f"{figures['killed']} of {figures['counted']} mutants killed ({score}) by "
             f"{', '.join(tests)}; {figures['mutants']} mutants in "
             f"{figures['seconds']:.0f} s.", ""]
    statuses = sorted({s for c in figures["by_file"].values() for s in c})
    lines += table(["file", *statuses],
                   [[code(f), *(str(c.get(s, 0)) for s in statuses)]
                    for f, c in figures["by_file"].items()])
    survivors = [r for r in rows if r["status"] == "survived"]
    if survivors:
        lines += ["", "## Survivors", ""]
        for row in survivors:
            lines += [f"### {code(row['name'])}", "", "```diff", row["diff"], "```", ""]
    (out / "generic.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="GLOB",
                        help="mutate the files matching this glob (repeatable; default "
                        f"{' '.join(MUTATE)})")
    parser.add_argument("--tests", action="append", default=[], metavar="PATH",
                        help="run the mutants against these tests (repeatable; default "
                        f"{' '.join(TESTS)})")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to mutate")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--children", type=int, default=os.cpu_count() or 1,
                        help="mutants run at once (default: the CPUs)")
    parser.add_argument("--read", action="store_true", help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)
    if args.read:  # in the workspace, for the parent below
        json.dump(read_results(), sys.stdout)
        return 0
    # What runs in the copy stays in it: no glob or test path may lead outside the root.
    try:
        for glob in args.only:
            mutated_files(args.root, glob)
    except ValueError as exc:
        parser.error(f"--only: {exc}")
    try:
        for test in args.tests:
            inside(args.root, test.split("::")[0])
    except ValueError as exc:
        parser.error(f"--tests: {exc}")
    with tempfile.TemporaryDirectory(prefix="kvh-mutmut-") as tmp:
        ws = Workspace(args.root, Path(tmp) / "tree")
        configure(ws.root, args.only, args.tests)
        start = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, "-m", "mutmut", "run",
                              f"--max-children={args.children}"], cwd=ws.root, env=env,
                             capture_output=True, text=True, check=False)
        seconds = time.monotonic() - start
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mutmut.log").write_text(run.stdout + run.stderr)
        if run.returncode != 0:
            print(f"mutmut failed (exit {run.returncode}); its output: {args.out / 'mutmut.log'}",
                  file=sys.stderr)
            return 2
        read = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--read"],
                              cwd=ws.root, capture_output=True, text=True, check=True)
        rows = json.loads(read.stdout)
    figures = summary(rows, seconds)
    write_report(rows, figures, args.out, args.tests or TESTS)
    print(f"{figures['killed']} of {figures['counted']} killed in {seconds:.0f} s; report in "
          f"{args.out / 'generic.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
