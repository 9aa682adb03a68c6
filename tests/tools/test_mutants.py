"""tools/mutants.py's catalogue: the project's applies to this checkout; entries that
cannot be applied are refused, naming the field; the figures of a report."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.tools.conftest import MUTANTS_TOOL


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
