"""tools/generic_mutants.py without running mutmut: the configuration it writes into the
workspace, the refusal of a pyproject that has one, and the report's counts and score."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from types import ModuleType

import pytest


def test_the_table_mutates_the_core_against_the_cache_tests(generic_mutants: ModuleType) -> None:
    table = tomllib.loads(generic_mutants.mutmut_table([]))["tool"]["mutmut"]
    assert table["only_mutate"] == ["kvcache/core/*"]
    assert table["source_paths"] == ["kvcache/"]
    assert table["pytest_add_cli_args_test_selection"] == list(generic_mutants.TESTS)
    assert "harness" in table["also_copy"]
    chosen = tomllib.loads(generic_mutants.mutmut_table(["kvcache/core/pool.py"],
                                                        ["tests/unit/core"]))["tool"]["mutmut"]
    assert chosen["only_mutate"] == ["kvcache/core/pool.py"]
    assert chosen["pytest_add_cli_args_test_selection"] == ["tests/unit/core"]


def test_every_selected_test_path_exists(generic_mutants: ModuleType) -> None:
    root = Path(generic_mutants.ROOT)
    assert [t for t in generic_mutants.TESTS if not (root / t).exists()] == []


def test_a_pyproject_with_its_own_table_is_refused(generic_mutants: ModuleType,
                                                   tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n')
    generic_mutants.configure(tmp_path, [])
    assert "[tool.mutmut]" in pyproject.read_text()
    before = pyproject.read_text()
    with pytest.raises(SystemExit, match=r"pyproject.toml: already has a \[tool.mutmut\]"):
        generic_mutants.configure(tmp_path, [])
    assert pyproject.read_text() == before


# Flags that would lead the generic pass outside its copy, each a bad input of
# docs/bad_inputs.md (tests/reliability/test_bad_inputs.py::test_catalogue_is_documented).
OUTSIDE_ROOT = [
    pytest.param(["--only", "/tmp/*"], "--only: '/tmp/*' is absolute",
                 id="generic-only-absolute"),
    pytest.param(["--only", "kvcache/../../*"], "--only: 'kvcache/../../*' climbs out of the "
                 "root with '..'", id="generic-only-climbs"),
    pytest.param(["--only", "harness/*"], "--only: 'harness/*' matches no .py file under "
                 "kvcache/", id="generic-only-matches-nothing"),
    pytest.param(["--only", "kvcache/core/link.py"], "--only: 'kvcache/core/link.py' "
                 "resolves to OUTSIDE/outside.py, outside the root", id="generic-only-symlink"),
    pytest.param(["--tests", "../elsewhere/test_x.py::t"], "--tests: '../elsewhere/test_x.py' "
                 "climbs out of the root with '..'", id="generic-tests-climbs"),
    pytest.param(["--tests", "/abs/test_x.py"], "--tests: '/abs/test_x.py' is absolute",
                 id="generic-tests-absolute"),
]
GENERIC_IDS = {p.id for p in OUTSIDE_ROOT}


@pytest.mark.parametrize(("argv", "message"), OUTSIDE_ROOT)
def test_a_path_outside_the_root_is_refused_before_any_copy(
        generic_mutants: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        argv: list[str], message: str) -> None:
    root = tmp_path / "root"
    (root / "kvcache" / "core").mkdir(parents=True)
    (root / "kvcache" / "core" / "pool.py").write_text("x = 1\n")
    (tmp_path / "outside.py").write_text("x = 1\n")
    (root / "kvcache" / "core" / "link.py").symlink_to(tmp_path / "outside.py")
    with pytest.raises(SystemExit) as info:  # argparse's error: exit 2, before mutmut
        generic_mutants.main(["--root", str(root), "--out", str(tmp_path / "out"), *argv])
    assert info.value.code == 2
    assert message.replace("OUTSIDE", str(tmp_path)) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert generic_mutants.mutated_files(root, "kvcache/core/p*") == ["kvcache/core/pool.py"]


ROWS = [{"name": "a.x__mutmut_1", "file": "a.py", "status": "killed", "diff": None},
        {"name": "a.x__mutmut_2", "file": "a.py", "status": "survived", "diff": "-1\n+2"},
        {"name": "a.x__mutmut_3", "file": "a.py", "status": "timeout", "diff": None},
        {"name": "b.y__mutmut_1", "file": "b.py", "status": "no tests", "diff": None},
        {"name": "b.y__mutmut_2", "file": "b.py", "status": "not checked", "diff": None}]


def test_the_score_counts_verdicts_only(generic_mutants: ModuleType) -> None:
    figures = generic_mutants.summary(ROWS, 10.0)
    # a timeout is a kill (the mutant hung the tests); a function no test calls counts
    # against; a mutant never checked is no verdict.
    assert (figures["killed"], figures["counted"]) == (2, 4)
    assert figures["score"] == 0.5 and figures["mutants_per_second"] == 0.5
    assert figures["by_file"] == {"a.py": {"killed": 1, "survived": 1, "timeout": 1},
                                  "b.py": {"no tests": 1, "not checked": 1}}


def test_the_report_shows_each_survivors_diff(generic_mutants: ModuleType,
                                              tmp_path: Path) -> None:
    generic_mutants.write_report(ROWS, generic_mutants.summary(ROWS, 10.0), tmp_path)
    md = (tmp_path / "generic.md").read_text()
    assert "2 of 4 mutants killed (50.0%)" in md
    assert "| `a.py` | 1 | 0 | 0 | 1 | 1 |" in md  # killed, no tests, not checked, ...
    assert "### `a.x__mutmut_2`" in md and "```diff\n-1\n+2\n```" in md
    assert "a.x__mutmut_1" not in md  # killed: no diff
    assert json.loads((tmp_path / "generic.json").read_text())["summary"]["killed"] == 2
