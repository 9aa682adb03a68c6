"""The harness's own mutation score: realistic reuse bugs, each applied to a copy of the
checkout, and the pre-merge selection run against it.

    python tools/mutants.py                      # every catalogue mutant, fail-fast
    python tools/mutants.py --only lru-reversed  # some of them (repeat --only)
    python tools/mutants.py --matrix             # every pre-merge test that kills each one
    nox -s mutants -- catalogue                  # the first; results/mutants/ gets
                                                 # report.md, report.json, ttff.png
                                                 # (plain `nox -s mutants` runs this,
                                                 # then tools/generic_mutants.py)

The catalogue (`tools/mutants.yaml`) holds each mutant as a small edit: in `file`, the
text `find` (it must occur exactly once) becomes `replace`, and `models` says in a
sentence what bug it stands for. The checkout is never touched: the tracked files are
copied once into a temporary folder, each mutant is written there and undone after its
run, and pytest runs in that folder (which comes first on its sys.path). A `file` that
is absolute, climbs with `..` or resolves outside the root through a symlink is refused
before anything is copied (it would be mutated in place, and stay mutated if the run
were killed); the checkout gets the kill record and, by default, results/mutants/ only.

For each mutant the report says killed or survived, by which test, and how many seconds
after launch the first failure came (start-up and collection included: what a developer
waits for). `--matrix` runs without `-x`, and only the tests that the durations file
(`test_lists/.test_durations`) records at MATRIX_MAX_SECONDS or less, and records every
failing one per mutant in `test_lists/.test_kills.json`, which the plugin's fail-first
order reads; a fail-fast run adds each mutant's first failing test to its entry there, so
a mutant that only a slow test kills has a killer on record too. A mutant
marked `equivalent` (with the reason why no test can tell it from the original) is run
and reported, and does not count against the score.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from harness.lists.kill_record import KILLS_NAME, load_kills, write_kills

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "tools" / "mutants.yaml"
KILLS = Path("test_lists") / KILLS_NAME  # under the root
RESULTS = ROOT / "results" / "mutants"
TOOLS = ROOT / "tools"
CLOCK_PLUGIN = "first_failure_clock"  # tools/first_failure_clock.py, loaded with -p
DURATIONS = Path("test_lists") / ".test_durations"  # under the root: seconds per test
# --matrix runs every test to the end, so only the cheap ones: those the durations file
# records at 1 s or less (2171 of 2181 pre-merge tests, 48 of 74 s, when this was set).
MATRIX_MAX_SECONDS = 1.0
PREMERGE = ("--kvh-test-db=test_lists/test-db", "--kvh-stage=pre_merge")
# The test that every catalogue `find` occurs in the checkout fails in a workspace by
# design (the mutant replaced one): every run deselects it.
SELF_CHECK = "tests/tools/test_mutants.py::test_the_project_catalogue_applies_to_this_checkout"
MUTANT_KEYS = frozenset({"id", "file", "find", "replace", "models", "area", "equivalent"})
AREAS = ("core", "window", "hybrid", "host", "metadata", "batch", "events", "stats",
         "engine", "scope", "storage", "attention", "model",
         "oracle", "lists", "plugin", "conform")  # the last four: the harness's own code

Status = Literal["killed", "survived", "timeout", "error"]


class CatalogueError(ValueError):
    """A catalogue entry that cannot be applied; the message names it and the field."""


def inside(root: Path, rel: str) -> Path:
    """`root / rel`, when `rel` is a relative path that stays inside `root` once symlinks
    are resolved. Raises ValueError naming `rel` for an absolute path, a `..` part, or a
    path that resolves outside (through a symlink): the tools write only into their copy,
    and a file outside it would be mutated in place, for good if the run is killed."""
    why = None
    if Path(rel).is_absolute():
        why = "is absolute"
    elif ".." in Path(rel).parts:
        why = "climbs out of the root with '..'"
    elif not (root / rel).resolve().is_relative_to(root.resolve()):
        why = f"resolves to {(root / rel).resolve()}, outside the root {root}"
    if why is not None:
        raise ValueError(f"{rel!r} {why}; a file is relative to the root and stays inside it")
    return root / rel


@dataclass(frozen=True)
class Mutant:
    """One catalogue entry: `find` becomes `replace` in `file` (relative to the root)."""

    id: str
    file: str
    find: str
    replace: str
    models: str
    area: str
    equivalent: str | None = None

    def apply(self, text: str, where: str) -> str:
        """`text` with the edit made; CatalogueError unless `find` occurs exactly once."""
        count = text.count(self.find)
        if count != 1:
            raise CatalogueError(f"{where}: mutant {self.id!r}: 'find' occurs {count} times in "
                                 f"{self.file} (it must occur exactly once)")
        return text.replace(self.find, self.replace)


@dataclass(frozen=True)
class Outcome:
    """How the selection fared against one mutant."""

    id: str
    area: str
    status: Status
    killer: str | None  # the first failing test
    seconds_to_first_failure: float | None  # from launch: start-up and collection included
    seconds: float  # the whole run
    killers: tuple[str, ...] = ()  # --matrix: every failing test
    equivalent: str | None = None


def load_catalogue(path: Path = CATALOGUE, root: Path = ROOT) -> list[Mutant]:
    """The mutants of `path`. Raises CatalogueError naming the entry and field for an
    unknown or missing key, a duplicate id, an unknown area, or a file that is outside
    `root` (absolute, climbing with `..`, a symlink out: `inside`) or does not exist."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    entries = data.get("mutants") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise CatalogueError(f"{path}: expected a mapping with a 'mutants' list")
    mutants: list[Mutant] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"{path}: mutants[{i}]"
        if not isinstance(entry, dict):
            raise CatalogueError(f"{where}: expected a mapping, got {entry!r}")
        unknown = sorted(set(entry) - MUTANT_KEYS)
        missing = sorted(MUTANT_KEYS - {"equivalent"} - set(entry))
        if unknown or missing:
            raise CatalogueError(f"{where}: unknown keys {unknown}, missing keys {missing}")
        for key in sorted(MUTANT_KEYS - {"equivalent"}):
            value = entry[key]
            if not isinstance(value, str) or (not value and key != "replace"):
                raise CatalogueError(f"{where}.{key}: expected a non-empty string"
                                     + (" (replace may be empty: a deletion)"
                                        if key == "replace" else "") + f", got {value!r}")
        if entry.get("equivalent") is not None and not (
                isinstance(entry["equivalent"], str) and entry["equivalent"]):
            raise CatalogueError(f"{where}.equivalent: expected the reason, a non-empty string")
        mutant = Mutant(**entry)
        if mutant.id in seen:
            raise CatalogueError(f"{where}.id: {mutant.id!r} is used twice")
        if mutant.area not in AREAS:
            raise CatalogueError(f"{where}.area: {mutant.area!r} is not one of {list(AREAS)}")
        try:
            file = inside(root, mutant.file)
        except ValueError as exc:
            raise CatalogueError(f"{where}.file: mutant {mutant.id!r}: {exc}") from None
        if not file.is_file():
            raise CatalogueError(f"{where}.file: {mutant.file} does not exist")
        if mutant.find == mutant.replace:
            raise CatalogueError(f"{where}.replace: the same as 'find': nothing is mutated")
        seen.add(mutant.id)
        mutants.append(mutant)
    return mutants


class Workspace:
    """A copy of the checkout's files (tracked, and untracked ones git does not ignore),
    compiled once, in which one mutant at a time is written and undone."""

    def __init__(self, root: Path, into: Path) -> None:
        self.root = into
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], cwd=root, check=True,
                                capture_output=True).stdout.decode().split("\0")
        for rel in filter(None, listed):
            src = root / rel
            if src.is_file():
                dst = into / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        subprocess.run([sys.executable, "-m", "compileall", "-q", "."], cwd=into, check=True)

    def path(self, rel: str) -> Path:
        """The copy of `rel`; ValueError when `rel` leads outside the copy (`inside`)."""
        return inside(self.root, rel)

    def write(self, rel: str, text: str) -> None:
        """Write `rel` and drop its compiled form (a same-size edit within the mtime's
        second would otherwise run the stale one). ValueError, writing nothing, when
        `rel` leads outside the copy."""
        path = self.path(rel)
        path.write_text(text, encoding="utf-8")
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink()


def _read_clock(clock: Path) -> tuple[str | None, float | None, tuple[str, ...]]:
    """(first failing test, its seconds from launch, every failing test) from the clock
    plugin's file; Nones and () when nothing failed."""
    if not clock.exists():
        return None, None, ()
    data = json.loads(clock.read_text(encoding="utf-8"))
    return data["nodeid"], float(data["seconds"]), tuple(data["failed"])


def run_selection(workspace: Path, pytest_args: Sequence[str], *, fail_fast: bool,
                  timeout: float, scratch: Path,
                  max_test_seconds: float | None = None) -> tuple[int | None, float, Path]:
    """Run pytest over `workspace` with the first-failure clock; returns (exit code, or
    None on timeout, seconds from launch to exit, the clock file). With
    `max_test_seconds`, only the tests the workspace's durations file records as at most
    that slow run."""
    clock = scratch / "first_failure.json"
    clock.unlink(missing_ok=True)
    # The run is a pytest of its own, never an xdist worker, even when this runs in one
    # (the clock stays silent in workers).
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("PYTEST_XDIST_")}
    env |= {"PYTHONPATH": str(TOOLS), "KVH_MUTANT_CLOCK": str(clock)}
    if max_test_seconds is not None:
        env |= {"KVH_MUTANT_MAX_SECONDS": repr(max_test_seconds),
                "KVH_MUTANT_DURATIONS": str(workspace / DURATIONS)}
    cmd = [sys.executable, "-m", "pytest", "-p", CLOCK_PLUGIN, "-q", "-p", "no:cacheprovider",
           f"--kvh-results-dir={scratch / 'results'}", f"--deselect={SELF_CHECK}",
           *(("-x",) if fail_fast else ()), *pytest_args]
    # The run's seconds start first, so its first failure, timed from KVH_MUTANT_T0,
    # never comes out later than its end, however long this thread waits in between.
    start = time.monotonic()
    env["KVH_MUTANT_T0"] = repr(time.time())
    try:
        code: int | None = subprocess.run(cmd, cwd=workspace, env=env, capture_output=True,
                                          timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - start, clock


def run_mutant(ws: Workspace, mutant: Mutant, pytest_args: Sequence[str], *, matrix: bool,
               timeout: float, scratch: Path) -> Outcome:
    """Apply `mutant` in `ws`, run the selection (fail-fast, or with `matrix` every test
    of at most MATRIX_MAX_SECONDS to the end), undo it; the outcome. Mutates the
    workspace only while it runs."""
    original = ws.path(mutant.file).read_text(encoding="utf-8")
    ws.write(mutant.file, mutant.apply(original, "tools/mutants.yaml"))
    try:
        code, seconds, clock = run_selection(
            ws.root, pytest_args, fail_fast=not matrix, timeout=timeout, scratch=scratch,
            max_test_seconds=MATRIX_MAX_SECONDS if matrix else None)
    finally:
        ws.write(mutant.file, original)
    killer, at, failed = _read_clock(clock)
    status: Status
    if code is None:
        status = "timeout" if killer is None else "killed"
    elif code in (0, 5):  # all passed (5: nothing selected, which kills nothing either)
        status = "survived"
    elif killer is not None:
        status = "killed"
    else:
        status = "error"  # pytest failed without a failing test: usage, collection
    return Outcome(mutant.id, mutant.area, status, killer, at, seconds,
                   failed if matrix else (), mutant.equivalent)


def score(outcomes: Sequence[Outcome]) -> tuple[int, int]:
    """(killed, counted): equivalent mutants are not counted."""
    counted = [o for o in outcomes if o.equivalent is None]
    return sum(o.status == "killed" for o in counted), len(counted)


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summary(outcomes: Sequence[Outcome], baseline: float | None) -> dict[str, Any]:
    """The figures the report leads with: the score (killed of counted), the ids that
    survived, are equivalent or were not killed (survived, timed out, errors), time to
    first failure of the killed ones (median, worst) and, given the clean run's seconds
    (`baseline`), both as fractions of it."""
    killed, counted = score(outcomes)
    times = [o.seconds_to_first_failure for o in outcomes
             if o.status == "killed" and o.seconds_to_first_failure is not None]
    median, worst = _median(times), max(times, default=None)
    out: dict[str, Any] = {"killed": killed, "counted": counted,
                           "survived": [o.id for o in outcomes
                                        if o.status == "survived" and o.equivalent is None],
                           "equivalent": [o.id for o in outcomes if o.equivalent is not None],
                           "not_killed": [o.id for o in outcomes
                                          if o.status != "killed" and o.equivalent is None],
                           "median_seconds_to_first_failure": median,
                           "worst_seconds_to_first_failure": worst,
                           "clean_run_seconds": baseline}
    if baseline and median is not None and worst is not None:
        out["median_fraction"] = median / baseline
        out["worst_fraction"] = worst / baseline
    return out


def write_report(outcomes: Sequence[Outcome], figures: dict[str, Any], out: Path,
                 mutants: dict[str, Mutant]) -> None:
    """Write report.json, report.md and ttff.png (the plot of time to first failure) into
    `out`, made if missing; `mutants` gives each outcome's `models` sentence."""
    from harness.reports.markdown import code, table  # the checkout's own escaping helper

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(
        {"summary": figures, "mutants": [asdict(o) for o in outcomes]}, indent=1))
    lines = ["# Mutation score of the pre-merge selection", "",
             f"{figures['killed']} of {figures['counted']} mutants killed."]
    if figures.get("median_fraction") is not None:
        lines.append(f"Time to first failure: median "
                     f"{figures['median_seconds_to_first_failure']:.1f} s "
                     f"({figures['median_fraction']:.0%} of the clean run's "
                     f"{figures['clean_run_seconds']:.0f} s), worst "
                     f"{figures['worst_seconds_to_first_failure']:.1f} s "
                     f"({figures['worst_fraction']:.0%}).")
    for key, what in (("not_killed", "Not killed"), ("equivalent", "Equivalent")):
        if figures[key]:
            lines.append(f"{what}: {', '.join(figures[key])}.")
    lines.append("")
    rows = [[code(o.id), o.area, o.status if o.equivalent is None else "equivalent",
             code(o.killer or "-"),
             "-" if o.seconds_to_first_failure is None else f"{o.seconds_to_first_failure:.1f}",
             mutants[o.id].models if o.id in mutants else ""] for o in outcomes]
    lines += table(["mutant", "area", "status", "first failing test", "seconds", "models"], rows)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _plot(outcomes, figures, out / "ttff.png")


def _plot(outcomes: Sequence[Outcome], figures: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    times = sorted(o.seconds_to_first_failure for o in outcomes
                   if o.seconds_to_first_failure is not None and o.status == "killed")
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title("Time to first failure per mutant (pre-merge, fail-fast)")
    ax.set_xlabel("seconds from launch (start-up and collection included)")
    ax.set_ylabel("mutants killed by then")
    ax.step(times, range(1, len(times) + 1), where="post")
    baseline = figures.get("clean_run_seconds")
    if baseline:
        for share, style in ((0.10, "--"), (0.35, ":")):
            ax.axvline(baseline * share, linestyle=style, color="grey",
                       label=f"{share:.0%} of the clean run")
        ax.legend()
    ax.grid(True, alpha=0.3)
    fig.savefig(path)


def record_kills(outcomes: Sequence[Outcome], path: Path, *, matrix: bool) -> None:
    """Update the kill record the fail-first order reads (harness.lists.kill_record) at
    `path`. A `matrix` run's killed mutant gets every failing test as its entry; a
    fail-fast run adds the first failing test to what the entry holds (the slow killers
    of mutants no cheap test kills). A survivor loses its entry, a run that ended in an
    error (no failing test) leaves it, and other mutants' entries stay. Raises
    ValueError naming the file for a record there that is not a kill record."""
    entries = {m: set(k) for m, k in load_kills(path).items()} if path.exists() else {}
    for o in outcomes:
        if o.status == "survived":
            entries.pop(o.id, None)
        elif o.status == "killed":
            found = set(o.killers) if matrix else {*entries.get(o.id, ()), o.killer}
            entries[o.id] = {k for k in found if k is not None}
    write_kills(path, entries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="ID",
                        help="run this mutant (repeatable, run in the order given; default: all, "
                        "in catalogue order)")
    parser.add_argument("--matrix", action="store_true",
                        help="no -x, the cheap tests only: every failing test becomes the "
                        "mutant's entry in test_lists/.test_kills.json (a fail-fast run adds "
                        "its first failing test to the entry)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to mutate")
    parser.add_argument("--catalogue", type=Path, default=CATALOGUE)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per mutant")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the clean run the fractions are measured against")
    parser.add_argument("pytest_args", nargs="*", help="what pytest selects (default: the "
                        "pre-merge lists); after --")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args or list(PREMERGE)
    try:
        catalogue = load_catalogue(args.catalogue, args.root)
    except CatalogueError as exc:  # before any copy or run
        print(exc, file=sys.stderr)
        return 2
    unknown = sorted(set(args.only) - {m.id for m in catalogue})
    if unknown:
        parser.error(f"--only: no mutant {unknown} in {args.catalogue}")
    by_id = {m.id: m for m in catalogue}
    chosen = [by_id[i] for i in dict.fromkeys(args.only)] if args.only else catalogue
    with tempfile.TemporaryDirectory(prefix="kvh-mutants-") as tmp:
        ws = Workspace(args.root, Path(tmp) / "tree")
        scratch = Path(tmp) / "run"
        scratch.mkdir()
        for mutant in chosen:  # a stale entry fails here, before any run
            mutant.apply(ws.path(mutant.file).read_text(encoding="utf-8"), str(args.catalogue))
        baseline = None
        if not args.no_baseline:
            code, baseline, _ = run_selection(
                ws.root, pytest_args, fail_fast=False, timeout=args.timeout, scratch=scratch,
                max_test_seconds=MATRIX_MAX_SECONDS if args.matrix else None)
            print(f"clean run: exit {code} in {baseline:.1f} s", flush=True)
            if code != 0:
                print("the clean run fails: no mutant can be judged", file=sys.stderr)
                return 2
        outcomes = []
        for mutant in chosen:
            outcome = run_mutant(ws, mutant, pytest_args, matrix=args.matrix,
                                 timeout=args.timeout, scratch=scratch)
            when = ("" if outcome.seconds_to_first_failure is None
                    else f" at {outcome.seconds_to_first_failure:.1f} s")
            print(f"{mutant.id}: {outcome.status}{when} ({outcome.killer or '-'})", flush=True)
            outcomes.append(outcome)
            # After each mutant: an interrupted run keeps what it measured.
            record_kills([outcome], args.root / KILLS, matrix=args.matrix)
    figures = summary(outcomes, baseline)
    write_report(outcomes, figures, args.out, {m.id: m for m in catalogue})
    print(f"{figures['killed']} of {figures['counted']} killed; report in {args.out}")
    return 0 if figures["killed"] == figures["counted"] else 1


if __name__ == "__main__":
    sys.exit(main())
