"""tools/mutants.py's catalogue: the project's applies to this checkout; entries that
cannot be applied are refused, naming the field; the figures of a report; what each
outcome does to the kill record."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.tools.conftest import CALC, MUTANTS_TOOL


@pytest.mark.parametrize(("edit", "message"), [
    pytest.param({"find": "return a * b"}, r"'find' occurs 0 times in calc\.py", id="stale"),
    pytest.param({"find": "return"}, r"'find' occurs 3 times in calc\.py", id="ambiguous"),
    pytest.param({"file": "nope.py"}, r"mutants\[0\]\.file: nope\.py does not exist",
                 id="no-file"),
    pytest.param({"area": "gpu"}, r"mutants\[0\]\.area: 'gpu' is not one of", id="area"),
    pytest.param({"bogus": 1}, r"unknown keys \['bogus'\]", id="unknown-key"),
    pytest.param({"models": ""}, r"mutants\[0\]\.models: expected a non-empty string",
                 id="no-model"),
    pytest.param({"replace": None}, r"mutants\[0\]\.replace: expected a non-empty string "
                 r"\(replace may be empty", id="no-replace"),
    pytest.param({"equivalent": ""}, r"mutants\[0\]\.equivalent: expected the reason",
                 id="equivalent-without-reason"),
    pytest.param({"replace": "return a + b"}, r"the same as 'find'", id="no-edit"),
])
def test_a_bad_entry_is_refused_before_any_run(mutants: ModuleType, calc_repo: Path,
                                               edit: dict[str, object], message: str) -> None:
    entry = {"id": "m", "file": "calc.py", "find": "return a + b", "replace": "return a - b",
             "models": "x", "area": "core", **edit}
    (calc_repo / "bad.yaml").write_text(json.dumps({"mutants": [entry]}))
    with pytest.raises(mutants.CatalogueError, match=message):
        for mutant in mutants.load_catalogue(calc_repo / "bad.yaml", calc_repo):
            mutant.apply((calc_repo / mutant.file).read_text(), "bad.yaml")


# Entries that would mutate a file outside the copy, each a bad input of
# docs/bad_inputs.md (tests/reliability/test_bad_inputs.py::test_catalogue_is_documented).
# OUTSIDE is ../outside.py, beside the checkout; REPO the checkout.
OUTSIDE_ROOT = [
    pytest.param("OUTSIDE", "'OUTSIDE' is absolute", id="mutants-file-absolute"),
    pytest.param("../outside.py", "'../outside.py' climbs out of the root with '..'",
                 id="mutants-file-climbs"),
    pytest.param("tests/../../outside.py", "'tests/../../outside.py' climbs out of the root "
                 "with '..'", id="mutants-file-climbs-inside"),
    pytest.param("link.py", "'link.py' resolves to OUTSIDE, outside the root REPO",
                 id="mutants-file-symlink"),
]
MUTANT_IDS = {p.id for p in OUTSIDE_ROOT}


@pytest.mark.parametrize(("file", "message"), OUTSIDE_ROOT)
def test_a_file_outside_the_root_is_refused_before_any_run(
        mutants: ModuleType, calc_repo: Path, capsys: pytest.CaptureFixture[str],
        file: str, message: str) -> None:
    outside = calc_repo.parent / "outside.py"
    outside.write_text(CALC)
    (calc_repo / "link.py").symlink_to(outside)
    file = file.replace("OUTSIDE", str(outside))
    entry = {"id": "escape", "file": file, "find": "return a + b", "replace": "return a - b",
             "models": "x", "area": "core"}
    (calc_repo / "bad.yaml").write_text(json.dumps({"mutants": [entry]}))
    message = message.replace("OUTSIDE", str(outside)).replace("REPO", str(calc_repo))
    expected = f"mutants[0].file: mutant 'escape': {message}; a file is relative to the " \
               "root and stays inside it"
    with pytest.raises(mutants.CatalogueError, match=re.escape(expected)):
        mutants.load_catalogue(calc_repo / "bad.yaml", calc_repo)
    # the command says so and stops before any copy or run: nothing is mutated, nothing
    # recorded (a run killed mid-mutant would have left outside.py mutated)
    assert mutants.main(["--root", str(calc_repo), "--catalogue", str(calc_repo / "bad.yaml"),
                         "--out", str(calc_repo.parent / "out"), "--", "tests"]) == 2
    assert expected in capsys.readouterr().err
    assert outside.read_text() == CALC
    assert not (calc_repo / "test_lists" / ".test_kills.json").exists()
    assert not (calc_repo.parent / "out").exists()


def test_the_workspace_writes_only_inside_itself(mutants: ModuleType, calc_repo: Path,
                                                 tmp_path: Path) -> None:
    ws = mutants.Workspace(calc_repo, tmp_path / "tree")
    for rel in ("../outside.py", str(tmp_path / "outside.py")):
        with pytest.raises(ValueError, match=re.escape(f"{rel!r}")):
            ws.write(rel, "x = 1\n")
    assert not (tmp_path / "outside.py").exists()
    ws.write("calc.py", "x = 1\n")
    assert (tmp_path / "tree" / "calc.py").read_text() == "x = 1\n"
    assert (calc_repo / "calc.py").read_text() == CALC


def test_an_empty_replace_deletes_the_text(mutants: ModuleType, calc_repo: Path) -> None:
    entry = {"id": "m", "file": "calc.py", "find": "    return 2 * x\n", "replace": "",
             "models": "double returns None", "area": "core"}
    (calc_repo / "del.yaml").write_text(json.dumps({"mutants": [entry]}))
    (mutant,) = mutants.load_catalogue(calc_repo / "del.yaml", calc_repo)
    text = (calc_repo / "calc.py").read_text()
    assert mutant.apply(text, "del.yaml") == text.replace("    return 2 * x\n", "")


def test_the_summary_counts_what_is_not_equivalent(mutants: ModuleType) -> None:
    outcome = mutants.Outcome
    outcomes = [outcome("a", "core", "killed", "t::a", 4.0, 9.0),
                outcome("b", "core", "killed", "t::b", 10.0, 12.0),
                outcome("c", "host", "survived", None, None, 30.0),
                outcome("d", "host", "survived", None, None, 30.0, (), "why"),
                outcome("e", "host", "timeout", None, None, 60.0)]
    figures = mutants.summary(outcomes, 40.0)
    assert (figures["killed"], figures["counted"]) == (2, 4)
    assert figures["survived"] == ["c"] and figures["equivalent"] == ["d"]
    assert figures["not_killed"] == ["c", "e"]
    assert figures["median_seconds_to_first_failure"] == 7.0
    assert figures["worst_seconds_to_first_failure"] == 10.0
    assert (figures["median_fraction"], figures["worst_fraction"]) == (7.0 / 40, 0.25)


def test_the_runner_deselects_this_files_catalogue_check(mutants: ModuleType) -> None:
    # in a workspace the mutated `find` is gone by design: the check below must not run
    path, name = mutants.SELF_CHECK.split("::")
    assert MUTANTS_TOOL.parents[1] / path == Path(__file__)
    assert callable(globals()[name])


def test_the_project_catalogue_applies_to_this_checkout(mutants: ModuleType) -> None:
    catalogue = mutants.load_catalogue()
    root = MUTANTS_TOOL.parents[1]
    for mutant in catalogue:  # every find text is still there, exactly once
        mutant.apply((root / mutant.file).read_text(encoding="utf-8"), "tools/mutants.yaml")
    assert len(catalogue) >= 30
    assert {m.area for m in catalogue} >= {"core", "window", "hybrid", "host", "metadata",
                                           "batch", "events", "stats"}
    assert all(m.models.endswith(".") for m in catalogue)  # each says its bug in a sentence


def test_each_outcome_updates_its_own_kill_record_entry(mutants: ModuleType,
                                                        tmp_path: Path) -> None:
    path = tmp_path / "test_lists" / ".test_kills.json"

    def outcome(mutant: str, status: str, killer: str | None = None,
                killers: tuple[str, ...] = ()) -> Any:
        return mutants.Outcome(mutant, "core", status, killer, None, 1.0, killers)

    mutants.record_kills([outcome("a", "killed", "t.py::b")], path, matrix=False)
    assert json.loads(path.read_text()) == {"mutants": {"a": ["t.py::b"]}}  # a new record
    path.write_text(json.dumps({"mutants": {"a": ["t.py::z"], "b": ["t.py::y"],
                                            "c": ["t.py::x"], "d": ["t.py::w"]}}))
    mutants.record_kills([outcome("a", "killed", "t.py::b"), outcome("b", "survived"),
                          outcome("c", "error")], path, matrix=False)
    # fail-fast adds its first failing test; a survivor loses its entry; an error and a
    # mutant not run keep theirs
    assert json.loads(path.read_text()) == {"mutants": {
        "a": ["t.py::b", "t.py::z"], "c": ["t.py::x"], "d": ["t.py::w"]}}
    mutants.record_kills([outcome("a", "killed", "t.py::q", ("t.py::q", "t.py::p"))], path,
                         matrix=True)
    assert json.loads(path.read_text())["mutants"]["a"] == ["t.py::p", "t.py::q"]  # replaced
    path.write_text('{"a": ["t.py::b"]}')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: a kill record is"):
        mutants.record_kills([outcome("a", "killed", "t.py::b")], path, matrix=False)
