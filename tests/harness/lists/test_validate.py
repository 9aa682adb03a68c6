"""Validation across lists, waives and the collected suite: duplicates, entries and waives
that select nothing, orphans (the waives format: test_waives.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.lists.db import load_test_db
from harness.lists.validate import (
    collect_node_ids,
    duplicate_problems,
    orphan_problems,
    unmatched_problems,
    validate,
)

HEAD = "version: 0.0.1\nl0_cpu:\n"


def block(stage: str, tests: list[str], gpus: str = "{gte: 0, lte: 0}", backend: str = "") -> str:
    extra = f"\n      attention_backend: {backend}" if backend else ""
    lines = "".join(f"  - {t}\n" for t in tests)
    return (f"- condition:\n    ranges:\n      system_gpu_count: {gpus}\n"
            f"    terms:\n      stage: {stage}{extra}\n  tests:\n{lines}")


def load(tmp_path: Path, text: str, name: str = "l0_cpu.yml") -> Path:
    db = tmp_path / "test-db"
    db.mkdir(exist_ok=True)
    (db / name).write_text(text)
    return db


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        pytest.param([block("pre_merge", ["tests/a.py", "tests/a.py"])],
                     ["10: duplicate entry 'tests/a.py' (also at "], id="same-block"),
        pytest.param([block("pre_merge", ["tests/a.py"]), block("pre_merge", ["tests/a.py::t"])],
                     ["16: entry 'tests/a.py::t' is already selected by 'tests/a.py' ("],
                     id="prefix-overlapping-blocks"),
        pytest.param([block("pre_merge", ["tests/a.py::t"]), block("pre_merge", ["tests"])],
                     ["9: entry 'tests/a.py::t' is already selected by 'tests' ("],
                     id="folder-later"),
        pytest.param([block("pre_merge", ["tests/a.py"]), block("post_merge", ["tests/a.py"])],
                     [], id="other-stage"),
        pytest.param([block("pre_merge", ["tests/a.py"], "{lte: 1}"),
                      block("pre_merge", ["tests/a.py"], "{gte: 2}")], [], id="disjoint-gpus"),
        pytest.param([block("pre_merge", ["tests/a.py"], backend="torch"),
                      block("pre_merge", ["tests/a.py"], backend="flashinfer")], [],
                     id="other-backend"),
        pytest.param([block("pre_merge", ["tests/a.py"], backend="torch"),
                      block("pre_merge", ["tests/a.py"])], ["17: duplicate entry"],
                     id="backend-and-any"),
    ],
)
def test_duplicates(tmp_path: Path, blocks: list[str], expected: list[str]) -> None:
    db = load_test_db(load(tmp_path, HEAD + "".join(blocks)))
    found = [str(p).removeprefix(str(tmp_path / "test-db" / "l0_cpu.yml") + ":")
             for p in duplicate_problems(db)]
    assert len(found) == len(expected)
    for text, start in zip(found, expected, strict=True):
        assert text.startswith(start), text


def test_same_entry_in_two_contexts_is_no_duplicate(tmp_path: Path) -> None:
    load(tmp_path, HEAD + block("pre_merge", ["tests/a.py"]))
    db = load_test_db(load(tmp_path, HEAD.replace("l0_cpu", "l0_h100") + block(
        "pre_merge", ["tests/a.py"], "{gte: 1}"), "l0_h100.yml"))
    assert duplicate_problems(db) == []


def test_unmatched_entries_say_whether_the_file_exists_and_what_is_close(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "a.py").write_text("")
    db = load_test_db(load(tmp_path, HEAD + block("pre_merge", [
        "tests/a.py::gone", "tests/zz.py", "tests/a.py::test_x[p16-fi]", "tests/b.py::test_q"])))
    collected = ["tests/a.py::gane", "tests/a.py::test_x[p16-fa]", "tests/a.py::test_x[p32-fi]",
                 "tests/a.py::test_y[p16-fi]", "tests/a.py::unrelated_name", "tests/za.py::t"]
    messages = [p.message for p in unmatched_problems(db.entries, tmp_path, collected)]
    assert messages == [
        "entry 'tests/a.py::gone' matches no collected test; closest: tests/a.py::gane",
        f"entry 'tests/zz.py': no such file or folder 'tests/zz.py' under {tmp_path}; "
        "closest: tests/za.py, tests/a.py",
        "entry 'tests/a.py::test_x[p16-fi]' matches no collected test; closest: "
        "tests/a.py::test_x[p16-fa], tests/a.py::test_x[p32-fi], tests/a.py::test_y[p16-fi]",
        f"entry 'tests/b.py::test_q': no such file or folder 'tests/b.py' under {tmp_path}; "
        "closest: tests/a.py::test_x, tests/a.py::test_y",
    ]


def test_orphans_are_grouped_by_file_with_their_likely_block(tmp_path: Path) -> None:
    db = load_test_db(load(tmp_path, HEAD + block("pre_merge", ["tests/a.py::t1"])
                           + block("post_merge", ["other/c.py"])))
    ids = ["tests/a.py::t1", "tests/a.py::t2", "lone/d.py::t"] + [
        f"tests/b.py::t[{i}]" for i in range(7)]
    found = [(str(p.location), p.message) for p in orphan_problems(db, ids)]
    where = f"{db.directory / 'l0_cpu.yml'}:3"
    assert found == [
        ("lone/d.py", "1 collected tests are in no list: t"),
        ("tests/a.py", "1 collected tests are in no list: t2; add 'tests/a.py' to l0_cpu[0] "
         f"({where}), next to 'tests/a.py::t1'"),
        ("tests/b.py", "7 collected tests are in no list: t[0], t[1], t[2], t[3], t[4], ...; add "
         f"'tests/b.py' to l0_cpu[0] ({where}), next to 'tests/a.py::t1'"),
    ]


def test_validate_against_a_real_collection(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(textwrap.dedent("""\
        import pytest
        @pytest.mark.parametrize("x", [1, 2], ids=["p1", "p2"])
        def test_par(x): pass
        def test_plain(): pass
        """))
    (tests / "test_orphan.py").write_text("def test_lonely(): pass\n")
    assert collect_node_ids(tmp_path, ["tests"]) == [
        "tests/test_a.py::test_par[p1]", "tests/test_a.py::test_par[p2]",
        "tests/test_a.py::test_plain", "tests/test_orphan.py::test_lonely"]
    db = load(tmp_path, HEAD + block("pre_merge", ["tests/test_a.py::test_par", "tests/test_a.py::gone"])
              + block("post_merge", ["tests/test_a.py::test_plain"]))
    waives = tmp_path / "waives.txt"
    waives.write_text("tests/test_a.py::test_par[p2] SKIP (x)\n"
                      "tests/test_a.py::test_par[p3] SKIP (https://nvbugs/2)\n"
                      "tests/test_a.py::test_plain SKIP x\n")
    result = validate(db, waives, tmp_path)
    assert [str(p).replace(str(tmp_path) + "/", "") for p in result.problems] == [
        "waives.txt:3: waive of 'tests/test_a.py::test_plain': unexpected 'x' after SKIP; a "
        "waive is '<node id> SKIP [(<reason>)] [<link>]' (line ignored)",
        "test-db/l0_cpu.yml:10: entry 'tests/test_a.py::gone' matches no collected test",
        "waives.txt:2: waive 'tests/test_a.py::test_par[p3]' matches no collected test; "
        "closest: tests/test_a.py::test_par[p1], tests/test_a.py::test_par[p2]",
        "tests/test_orphan.py: 1 collected tests are in no list: test_lonely; add "
        "'tests/test_orphan.py' to l0_cpu[0] (test-db/l0_cpu.yml:3), next to "
        "'tests/test_a.py::test_par'",
    ]
    assert [str(p).replace(str(tmp_path) + "/", "") for p in result.warnings] == [
        "waives.txt:1: waive 'tests/test_a.py::test_par[p2]' has no link to an issue; write "
        "SKIP (https://...)"]
    assert result.summary() == ("4 problems, 1 warnings: 2 blocks, 3 entries, 2 waives, "
                                "4 collected tests")
