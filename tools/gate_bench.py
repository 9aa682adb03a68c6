"""The gate's clean pass against an older commit's, back to back on one machine.

Exports this checkout's HEAD and a base commit (default 7215b7d, the gate before the
fail-first order and the harness's own nested pytest runs) with `git archive`, runs each
one's serial pre-merge selection (`nox -s premerge -- -n 0` without nox: this
interpreter, each tree first on the path), then, with `--parallel N`, HEAD's pre-merge
under N pytest-xdist workers, and prints the seconds, the tests each ran (from its junit
XML) and the ratios: HEAD's serial pass over the base's (the target is <= 1.0) and the
parallel pass over the serial one (<= 0.6). A benchmark, never a test: its figures
depend on the machine and on what else runs there, so it belongs on a quiet one.
Writes gate_bench.json into --out (results/gate_bench/, as `nox -s gate_bench`). Run it
from a venv with the test extra (`pip install -e ".[test]"`), its bin first on PATH (a
test runs `kvharness`).

Each tree runs with its own spelling of the harness's flags (`--kvh-test-db` now,
`--test-db` before the rename), read from `pytest --help` in that tree. Each tree's
selection is collected once, untimed, before its passes, so no pass pays for compiling
the bytecode a later one reads (where the tree's suite writes it). A run that fails is
still timed and said to have failed: its time is not a clean pass's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
BASE = "7215b7d"
RESULTS = ROOT / "results" / "gate_bench"
# `nox -s premerge`'s scheduling (noxfile.py's PARALLEL, less the worker count).
SCHEDULING = ("--dist", "load", "--maxschedchunk", "1")
SERIAL_TARGET, PARALLEL_TARGET = 1.0, 0.6


class Run(NamedTuple):
    """One timed pre-merge pass: what ran it and what it took."""

    label: str  # "base" or "head"
    commit: str
    workers: int  # 0: serial
    seconds: float
    tests: int  # test cases in its junit XML
    failed: int  # failures and errors among them
    exit_code: int


def export(repo: Path, commit: str, into: Path) -> str:
    """Write the files of `commit` of `repo` into the folder `into` (made; it must not
    exist) with `git archive`; returns the commit's full hash. Touches nothing of the
    repository. Raises subprocess.CalledProcessError for a commit git cannot resolve."""
    full = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", full], cwd=repo, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return full


def flag_prefix(help_text: str) -> str:
    """The harness's flag prefix in a tree whose `pytest --help` printed `help_text`:
    `--kvh-` where the flags carry it, else `--` (the spelling before the rename).
    Raises ValueError when the harness's test-db flag is in neither spelling."""
    if "--kvh-test-db" in help_text:
        return "--kvh-"
    if "--test-db" in help_text:
        return "--"
    raise ValueError("pytest --help names no --kvh-test-db or --test-db: the harness's "
                     "plugin is not loaded in this tree")


def premerge_command(python: str, prefix: str, junit: Path | None, workers: int) -> list[str]:
    """The pre-merge selection of the tree in the working folder, as `nox -s premerge`
    runs it: serially for `workers` 0, else under that many xdist workers, scheduled
    as nox schedules them; with `junit` None, collected only."""
    xdist = ["-n", "0"] if workers == 0 else ["-n", str(workers), *SCHEDULING]
    report = ["--collect-only"] if junit is None else [f"--junitxml={junit}"]
    return [python, "-m", "pytest", f"{prefix}test-db=test_lists/test-db",
            f"{prefix}stage=pre_merge", *report, "-q", "-p", "no:cacheprovider", *xdist]


def junit_counts(path: Path) -> tuple[int, int]:
    """(test cases, failed ones: a failure or an error) in the junit XML at `path`; (0, 0)
    when the run wrote none."""
    if not path.exists():
        return 0, 0
    cases = list(ET.parse(path).getroot().iter("testcase"))
    failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    return len(cases), failed


def tree_env(tree: Path) -> dict[str, str]:
    """This environment with `tree` first on the path (its kvcache, harness and plugin),
    without the variables of a pytest or xdist run this one may be inside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(tree)
    return env


def tree_prefix(tree: Path, python: str) -> str:
    """The harness's flag prefix in `tree` (see `flag_prefix`), from its `pytest --help`."""
    shown = subprocess.run([python, "-m", "pytest", "--help"], cwd=tree, env=tree_env(tree),
                           capture_output=True, text=True, check=False)
    return flag_prefix(shown.stdout)


def warm_up(tree: Path, python: str) -> None:
    """Collect the pre-merge selection of `tree` once, untimed and unchecked (a pass that
    cannot collect says so when it is timed)."""
    subprocess.run(premerge_command(python, tree_prefix(tree, python), None, 0), cwd=tree,
                   env=tree_env(tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)


def timed_pass(label: str, commit: str, tree: Path, python: str, workers: int,
               out: Path) -> Run:
    """Run the pre-merge selection of `tree` once and time it (the wall clock around the
    pytest process, start-up and collection included)."""
    env = tree_env(tree)
    junit = out / f"junit-{label}-n{workers}.xml"
    args = premerge_command(python, tree_prefix(tree, python), junit, workers)
    print(f"{label} {commit[:12]}: {' '.join(args[1:])}", flush=True)
    start = time.monotonic()
    done = subprocess.run(args, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, check=False)
    seconds = time.monotonic() - start
    tests, failed = junit_counts(junit)
    return Run(label, commit, workers, seconds, tests, failed, done.returncode)


def summarize(runs: Sequence[Run]) -> tuple[dict[str, float | None], list[str]]:
    """The ratios (head serial / base serial, head parallel / head serial; None where a
    pass is missing) and the lines that say each pass and ratio, a failed pass flagged."""
    by = {(r.label, r.workers): r for r in runs}
    lines = []
    for r in runs:
        mode = "serial" if r.workers == 0 else f"{r.workers} workers"
        verdict = "" if r.exit_code == 0 else (
            f"  FAILED (exit {r.exit_code}, {r.failed} failed): not a clean pass")
        lines.append(f"{r.label} {r.commit[:12]} {mode}: {r.seconds:.1f} s, {r.tests} tests"
                     + verdict)
    head, base = by.get(("head", 0)), by.get(("base", 0))
    parallel = next((r for r in runs if r.label == "head" and r.workers > 0), None)
    ratios: dict[str, float | None] = {
        "serial_over_base": head.seconds / base.seconds if head and base else None,
        "parallel_over_serial": parallel.seconds / head.seconds if head and parallel else None}
    for name, target in (("serial_over_base", SERIAL_TARGET),
                         ("parallel_over_serial", PARALLEL_TARGET)):
        ratio = ratios[name]
        if ratio is not None:
            lines.append(f"{name.replace('_', ' ')}: {ratio:.2f} (target <= {target})")
    return ratios, lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=BASE, help=f"the commit to compare with (default "
                        f"{BASE})")
    parser.add_argument("--head", default="HEAD", help="the commit measured (default HEAD: "
                        "what is committed, not the working tree)")
    parser.add_argument("--parallel", type=int, default=2, metavar="N",
                        help="also run head under N xdist workers (0: not; default 2)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter both run under (default: this one)")
    parser.add_argument("--base-python", metavar="PYTHON",
                        help="the base's interpreter where its test dependencies differ "
                             "(7215b7d's plugin defines --reruns, which pytest-rerunfailures, "
                             "a test dependency since, also does; default: --python)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.parallel < 0:
        parser.error(f"--parallel: {args.parallel} is not a worker count >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvh-gate-bench-") as tmp:
        trees = {}
        for label, commit in (("base", args.base), ("head", args.head)):
            tree = Path(tmp) / label
            trees[label] = (export(ROOT, commit, tree), tree)
        plan = [("base", 0), ("head", 0)] + ([("head", args.parallel)] if args.parallel else [])
        pythons = {"base": args.base_python or args.python, "head": args.python}
        for label, (_, tree) in trees.items():
            warm_up(tree, pythons[label])
        runs = [timed_pass(label, trees[label][0], trees[label][1], pythons[label], workers,
                           args.out) for label, workers in plan]
    ratios, lines = summarize(runs)
    print("\n".join(lines))
    (args.out / "gate_bench.json").write_text(json.dumps(
        {"runs": [r._asdict() for r in runs], "ratios": ratios}, indent=1) + "\n")
    return 0 if all(r.exit_code == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
