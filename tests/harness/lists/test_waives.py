"""waives.txt in TensorRT-LLM's syntax: `SKIP (https://nvbugs/...)`, bare `SKIP`, reasons
without links, `full:<GPU>/` scopes, `# comments`; a bad line is reported with its file
and line while the other waives still apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.lists.errors import ListError
from harness.lists.waives import load_waives, waive_for

# Lines as TensorRT-LLM's waives.txt writes them (ids made local).
WAIVES = """\
# known failures
tests/a.py::t[p1] SKIP (https://nvbugs/5100001)
full:B200/tests/a.py::t[p2] SKIP (https://nvbugs/5100002)
full:H100_PCIe/tests/b.py SKIP (fails on PCIe) https://github.com/o/r/issues/3
tests/c.py::test_x SKIP
tests/c.py::test_y SKIP (flaky copy (issue) on B200)  # owner: kv team
tests/d.py SKIP (https://github.com/o/r/issues/7#issuecomment-1)
"""


@pytest.fixture
def waives_file(tmp_path: Path) -> Path:
    path = tmp_path / "waives.txt"
    path.write_text(WAIVES)
    return path


def test_tensorrt_llm_lines_parse(waives_file: Path) -> None:
    read = load_waives(waives_file)
    assert read.problems == ()
    assert [(w.text, w.reason, w.link, w.location.line) for w in read.waives] == [
        ("tests/a.py::t[p1]", "https://nvbugs/5100001", "https://nvbugs/5100001", 2),
        ("full:B200/tests/a.py::t[p2]", "https://nvbugs/5100002", "https://nvbugs/5100002", 3),
        ("full:H100_PCIe/tests/b.py", "fails on PCIe", "https://github.com/o/r/issues/3", 4),
        ("tests/c.py::test_x", None, None, 5),
        ("tests/c.py::test_y", "flaky copy (issue) on B200", None, 6),
        ("tests/d.py", "https://github.com/o/r/issues/7#issuecomment-1",
         "https://github.com/o/r/issues/7#issuecomment-1", 7),
    ]
    reasons = {w.test: w.skip_reason for w in read.waives}
    assert reasons["tests/a.py::t[p1]"] == "waived: https://nvbugs/5100001"
    assert reasons["tests/b.py"] == "waived: fails on PCIe (https://github.com/o/r/issues/3)"
    assert reasons["tests/c.py::test_x"] == "waived (no reason given)"
    assert [p.location.line for p in read.without_link()] == [5, 6]


@pytest.mark.parametrize(
    ("gpu", "prefix", "expected"),
    [
        pytest.param("cpu", None, ["tests/a.py::t[p1]", "tests/c.py::test_x"], id="cpu"),
        pytest.param("NVIDIA B200", None,
                     ["tests/a.py::t[p1]", "tests/a.py::t[p2]", "tests/c.py::test_x"], id="b200"),
        pytest.param("NVIDIA GB200", None, ["tests/a.py::t[p1]", "tests/c.py::test_x"],
                     id="gb200-is-not-b200"),
        pytest.param("NVIDIA H100 PCIe", None,
                     ["tests/a.py::t[p1]", "tests/b.py", "tests/c.py::test_x"], id="h100-pcie"),
        pytest.param("NVIDIA H100 80GB HBM3", None, ["tests/a.py::t[p1]", "tests/c.py::test_x"],
                     id="h100-sxm"),
        # TensorRT-LLM's rule: the test prefix's first '-' part names the GPU kind.
        pytest.param("cpu", "B200-PyTorch-1",
                     ["tests/a.py::t[p1]", "tests/a.py::t[p2]", "tests/c.py::test_x"],
                     id="prefix-b200"),
        pytest.param("NVIDIA B200", "H100-PyTorch-1", ["tests/a.py::t[p1]", "tests/c.py::test_x"],
                     id="prefix-wins"),
    ],
)
def test_full_prefix_scopes_a_waive_to_one_gpu_kind(
    waives_file: Path, gpu: str, prefix: str | None, expected: list[str]
) -> None:
    here = load_waives(waives_file).on(gpu, prefix)
    node_ids = ["tests/a.py::t[p1]", "tests/a.py::t[p2]", "tests/b.py::test_q",
                "tests/c.py::test_x"]
    hits = {n: waive_for(here, n) for n in node_ids}
    assert sorted(w.test for w in hits.values() if w is not None) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("tests/a.py skip (x)\n", "is not '[full:<GPU>/]<node id> SKIP", id="lower-case"),
        pytest.param("tests/a.py XFAIL (x)\n", "only SKIP is a waive here (XFAIL is not)",
                     id="xfail"),
        pytest.param("tests/a.py SKIP (x\n", "'(' of the reason is never closed", id="unclosed"),
        pytest.param("tests/a.py SKIP (x) nvbugs/123\n", "unexpected 'nvbugs/123' after SKIP",
                     id="bad-link"),
        pytest.param("/abs/a.py SKIP (x)\n", "relative to the repository root", id="absolute"),
        pytest.param("tests/a.py\n", "is not '[full:<GPU>/]<node id> SKIP", id="no-marker"),
        pytest.param("tests/a.py SKIP\ntests/a.py SKIP (y)\n",
                     "'tests/a.py' is waived twice (first at line 2)", id="twice"),
    ],
)
def test_a_bad_line_is_a_problem_and_the_rest_apply(tmp_path: Path, text: str,
                                                    fragment: str) -> None:
    path = tmp_path / "waives.txt"
    path.write_text("tests/ok.py SKIP (https://nvbugs/1)\n" + text)
    read = load_waives(path)
    [problem] = read.problems
    assert fragment in problem.message and problem.message.endswith("(line ignored)")
    assert problem.location == (path, len(text.splitlines()) + 1)
    assert read.waives[0].test == "tests/ok.py"


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        pytest.param(lambda p: p.mkdir(), "waives file is a directory", id="directory"),
        pytest.param(lambda p: p.write_bytes(b"tests/a.py SKIP (\xff)\n"),
                     "waives file is not UTF-8 text: byte 0xff at offset 17", id="not-utf8"),
        pytest.param(lambda p: None, "waives file does not exist", id="missing"),
    ],
)
def test_an_unreadable_file_is_a_list_error_naming_it(tmp_path: Path, make: object,
                                                      fragment: str) -> None:
    path = tmp_path / "waives.txt"
    make(path)  # type: ignore[operator]
    with pytest.raises(ListError) as caught:
        load_waives(path)
    assert str(caught.value).startswith(str(path)) and fragment in str(caught.value)
