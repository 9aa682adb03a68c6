"""The kill record's one home: what the plugin reads (a bad record is refused naming the
file), what tools/mutants.py writes (sorted, whole or not at all), and that one reads
back what the other wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.lists.kill_record import KILLS_NAME, load_kills, write_kills


@pytest.mark.parametrize(("text", "message"), [
    ("[]", r"a kill record is \{\"mutants\""),
    ('{"mutants": {"m1": "t.py::test_a"}}', r"mutant 'm1': the tests that killed it are a list"),
    ('{"mutants": {"m1": [3]}}', r"mutant 'm1'"),
    ("{not json", r"not a readable kill record"),
])
def test_bad_kill_records(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / ".test_kills.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_kills(path)
    assert str(info.value).startswith(str(path))


def test_a_kill_record_reads_back(tmp_path: Path) -> None:
    path = tmp_path / ".test_kills.json"
    path.write_text(json.dumps({"mutants": {"m1": ["t.py::test_a", "t.py::test_a"], "m2": []}}))
    assert load_kills(path) == {"m1": frozenset({"t.py::test_a"}), "m2": frozenset()}


def test_what_is_written_reads_back_sorted(tmp_path: Path) -> None:
    path = tmp_path / "lists" / KILLS_NAME  # the folder is made
    kills = {"m2": ["t.py::test_c", "t.py::test_a", "t.py::test_c"], "m1": set(), "m0": ()}
    write_kills(path, kills)
    assert load_kills(path) == {"m0": frozenset(), "m1": frozenset(),
                                "m2": frozenset({"t.py::test_a", "t.py::test_c"})}
    # sorted and each id once, so a run that finds the same kills leaves the same bytes
    assert path.read_text() == ('{\n "mutants": {\n  "m0": [],\n  "m1": [],\n  "m2": [\n'
                                '   "t.py::test_a",\n   "t.py::test_c"\n  ]\n }\n}\n')
    assert sorted(p.name for p in path.parent.iterdir()) == [KILLS_NAME]


def test_a_write_replaces_the_record_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / KILLS_NAME
    write_kills(path, {"m1": ["t.py::test_a"], "m2": ["t.py::test_b"]})
    write_kills(path, {"m3": ["t.py::test_c"]})
    assert load_kills(path) == {"m3": frozenset({"t.py::test_c"})}  # replaced, not merged
    before = path.read_bytes()
    (tmp_path / f"{KILLS_NAME}.partial").mkdir()  # the side file cannot be written
    with pytest.raises(OSError):
        write_kills(path, {"m4": ["t.py::test_d"]})
    assert path.read_bytes() == before  # the old record stands, untruncated
