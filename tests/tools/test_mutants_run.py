"""tools/mutants.py end to end on a small git repository (post-merge: about 50 s of
pytest runs): a mutant its tests catch, one they miss, one marked equivalent."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from tests.tools.conftest import CALC


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (symlinks as their targets' paths) and its bytes."""
    return {str(p.relative_to(root)): str(p.readlink()).encode() if p.is_symlink()
            else p.read_bytes() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def test_each_mutant_is_judged_and_the_checkout_is_untouched(mutants: ModuleType,
                                                             calc_repo: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    kills = calc_repo / "test_lists" / ".test_kills.json"
    kills.parent.mkdir(exist_ok=True)
    kills.write_text(json.dumps({"mutants": {"add-minus": ["tests/z.py::t"],
                                             "double-plus": ["tests/y.py::t"]}}))
    before = _files(calc_repo)
    code = mutants.main(["--root", str(calc_repo), "--catalogue",
                         str(calc_repo / "mutants.yaml"), "--out", str(out), "--", "tests"])
    assert code == 1  # one counted mutant survived
    # The checkout's only change is the declared output: the kill record (git's own
    # folder included: nothing is staged, nothing left behind).
    after = _files(calc_repo)
    assert {f for f in before.keys() | after.keys() if before.get(f) != after.get(f)} == {
        "test_lists/.test_kills.json"}
    report = json.loads((out / "report.json").read_text())
    by_id = {m["id"]: m for m in report["mutants"]}
    assert by_id["add-minus"]["status"] == "killed"
    assert by_id["add-minus"]["killer"] == "tests/test_calc.py::test_add"
    assert 0 < by_id["add-minus"]["seconds_to_first_failure"] <= by_id["add-minus"]["seconds"]
    assert by_id["add-minus"]["killers"] == []  # fail-fast: the first one only
    assert by_id["double-plus"]["status"] == "survived"
    assert by_id["square-pow"]["status"] == "survived"
    summary = report["summary"]
    assert (summary["killed"], summary["counted"]) == (1, 2)  # the equivalent one is not counted
    assert summary["survived"] == ["double-plus"]
    assert summary["equivalent"] == ["square-pow"]
    assert summary["clean_run_seconds"] > 0 and summary["median_fraction"] > 0
    md = (out / "report.md").read_text()
    assert "1 of 2 mutants killed" in md and "`add-minus`" in md
    assert (out / "ttff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A fail-fast run adds each first failing test to the mutant's entry; a survivor
    # loses its entry (the equivalent one had none).
    assert json.loads(kills.read_text()) == {"mutants": {
        "add-minus": ["tests/test_calc.py::test_add", "tests/z.py::t"]}}
    assert sorted(p.name for p in kills.parent.iterdir()) == [".test_durations",
                                                            ".test_kills.json"]
    assert (calc_repo / "calc.py").read_text() == CALC  # mutated in a copy only


def test_the_matrix_records_every_cheap_killer(mutants: ModuleType, calc_repo: Path,
                                               tmp_path: Path) -> None:
    kills = calc_repo / "test_lists" / ".test_kills.json"
    kills.write_text(json.dumps({"mutants": {"gone": ["tests/x.py::t"],
                                             "double-plus": ["tests/y.py::t"]}}))
    code = mutants.main(["--root", str(calc_repo), "--catalogue",
                         str(calc_repo / "mutants.yaml"), "--out", str(tmp_path / "out"),
                         "--matrix", "--only", "double-plus", "--only", "add-minus",
                         "--no-baseline", "--", "tests"])
    assert code == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [m["id"] for m in report["mutants"]] == ["double-plus", "add-minus"]  # as given
    # test_add_slowly kills add-minus too, but is recorded at 5 s, over the threshold;
    # a mutant not run keeps its entry, one that survived loses its own
    assert json.loads(kills.read_text()) == {"mutants": {
        "add-minus": ["tests/test_calc.py::test_add"], "gone": ["tests/x.py::t"]}}
    assert (calc_repo / "calc.py").read_text() == CALC
