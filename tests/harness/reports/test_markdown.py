"""Every markdown table the harness writes keeps its columns whatever a test id, a
parameter or a message holds: `kvharness flakes` wrote ids with `|` unescaped (GitHub then
split the row), and other tables did the same with parameters, reasons and names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.cli import main as kvharness
from harness.gpu_check.report import CheckResult, Report, StageResult
from harness.reports.markdown import Markdown, cell, code, table
from harness.reports.summary import ReuseRecord, ReuseReport, summarize

# Each breaks a row its own way: a cell separator, a line break, a code span's fence.
HOSTILE_ID = "tests/test_m.py::test_x[a|b-`q`-c\\|d]"
HOSTILE_TEXT = "bad | value\nsecond line `tick` and \\ slash"


def cells(row: str) -> list[str]:
    """The cells of one GFM table row: split at every `|` no backslash escapes."""
    assert row.startswith("| ") and row.endswith(" |"), row
    return [c.strip() for c in re.split(r"(?<!\\)\|", row[1:-1])]


def tables(text: str) -> list[list[list[str]]]:
    """Every table in `text` (runs of lines starting with `|`) as rows of cells."""
    found: list[list[list[str]]] = []
    previous = ""
    for line in text.splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):
                found.append([])
            if not re.fullmatch(r"\|(---\|)+", line):
                found[-1].append(cells(line))
        previous = line
    return found


def assert_intact(text: str) -> None:
    """Every row of every table has its header's cell count, and no line of a table
    ends inside a row (a row's text was split over lines)."""
    found = tables(text)
    assert found, f"no table in:\n{text}"
    for rows in found:
        widths = {len(r) for r in rows}
        assert widths == {len(rows[0])}, f"rows of {widths} cells under {rows[0]}:\n{text}"


def decode_code(text: str) -> str:
    """The text of a code cell as GFM shows it: the fence and its padding removed, `\\|`
    unescaped (GFM does so inside code spans too)."""
    fence = re.match(r"`+", text)
    assert fence is not None and text.endswith(fence[0]), text
    inner = text[len(fence[0]):-len(fence[0])]
    if inner.startswith(" ") and inner.endswith(" ") and inner.strip():
        inner = inner[1:-1]
    return inner.replace("\\|", "|")


def test_flakes_escapes_test_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junit = tmp_path / "run1.xml"
    junit.write_text('<testsuite><testcase classname="tests.test_m" file="tests/test_m.py" '
                     'name="test_x[a|b-`q`-c\\|d]"><failure message="x"/></testcase>'
                     "</testsuite>")
    assert kvharness(["flakes", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert_intact(out)
    [[header, row]] = tables(out)
    assert header == ["test", "runs", "failures", "failure rate", "passed on rerun"]
    assert decode_code(row[0]) == HOSTILE_ID
    assert row[1:] == ["1", "1", "100%", "0"]


def test_the_reuse_report_escapes_every_cell() -> None:
    record = ReuseRecord("s", HOSTILE_ID, {"k": HOSTILE_TEXT}, {"reusedBlocks": 1},
                         {"reusedBlocks": 2}, False)
    text = ReuseReport([record]).markdown()
    assert_intact(text)
    [[_, row]] = tables(text)
    assert decode_code(row[0]) == HOSTILE_ID
    assert row[1] == "k=bad \\| value second line \\`tick\\` and \\\\ slash"
    assert row[-1] == "**FAIL**"


def test_the_results_summary_escapes_every_cell(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(
        '<testsuite><testcase classname="tests.test_m" file="tests/te|st.py" name="test_a">'
        '<failure message="bad | value&#10;second"/></testcase>'
        '<testcase classname="tests.test_m" file="tests/test_m.py" name="test_x[a|b-`q`-c\\|d]">'
        '<skipped message="waived: flaky | slow (https://x/1)"/></testcase></testsuite>')
    record = ReuseRecord("scen|ario", "t", {}, {"reusedBlocks": 1, "missedBlocks": 0}, None, True)
    ReuseReport([record]).write(tmp_path)
    (tmp_path / "bench.json").write_text(
        '{"benchmarks": [{"name": "test_b[x|y]", "stats": {"min": 1, "max": 1, "mean": 1, '
        '"median": 1, "rounds": 1, "ops": 1}, "extra_info": {"note": "a|b"}}]}')
    text = summarize(tmp_path)
    assert_intact(text)
    failing = next(t for t in tables(text) if t[0] == ["test", "first line"])
    assert failing[1] == ["`tests/te\\|st.py::test_a`", "bad \\| value"]
    waived = next(t for t in tables(text) if t[0] == ["test", "reason"])
    assert decode_code(waived[1][0]) == HOSTILE_ID


def test_the_gpu_check_report_escapes_every_cell() -> None:
    check = CheckResult("fp16", HOSTILE_ID, "failed", 1.0, 0.5, 0.1, HOSTILE_TEXT,
                        ("fa|2",), message="boom")
    stages = (StageResult("fp16", "fp16", "ran", 1.0, HOSTILE_TEXT, (check,)),)
    text = Report({"GPU": "H200 | x1", "torch": "2.9"}, 10, 1, stages).markdown()
    assert_intact(text)
    checks = next(t for t in tables(text) if t[0][1] == "check")
    assert decode_code(checks[1][1]) == HOSTILE_ID.split("::", 1)[1]


@pytest.mark.parametrize(("value", "expected"), [
    ("plain", "plain"),
    ("a|b", "a\\|b"),
    ("one\ntwo\r\nthree\rfour", "one two three four"),
    ("a `b` c", "a \\`b\\` c"),
    ("C:\\dir\\|x", "C:\\\\dir\\\\\\|x"),
    (42, "42"),
    (Markdown("**kept**"), "**kept**"),
])
def test_cell(value: object, expected: str) -> None:
    assert cell(value) == expected


@pytest.mark.parametrize(("value", "expected"), [
    ("tests/a.py::t", "`tests/a.py::t`"),
    ("t[a|b]", "`t[a\\|b]`"),
    ("t[`x`]", "``t[`x`]``"),
    ("t[``]x", "```t[``]x```"),
    ("`", "`` ` ``"),
    ("a\nb", "`a b`"),
])
def test_code(value: str, expected: str) -> None:
    assert code(value) == expected
    assert decode_code(code(value)) == value.replace("\n", " ")


def test_table_escapes_cells_and_keeps_markdown() -> None:
    assert table(["a|b", "c"], [[code("x|y"), "p|q"], [1, Markdown("**z**")]]) == [
        "| a\\|b | c |", "|---|---|", "| `x\\|y` | p\\|q |", "| 1 | **z** |"]
